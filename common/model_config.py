"""Writing a model's config.pbtxt, for the repositories meshserve writes itself (quantize/,
devmesh/); the worker reads and completes them (worker/config.py). The keys are in
common/model_keys.py."""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import text_format

from protos import model_config_pb2 as mc


def config_text(
    name: str,
    max_batch_size: int,
    max_queue_delay_us: int,
    parameters: Mapping[str, str],
    all_versions: bool = False,
    platform: str = "",
) -> str:
    """A config.pbtxt with dynamic batching, for the repositories meshserve writes itself."""
    config = mc.ModelConfig(name=name, platform=platform, max_batch_size=max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    if all_versions:
        config.version_policy.all.SetInParent()
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return text_format.MessageToString(config)
