"""The model repository the quantize CLI builds: OUTPUT/<model>/ with fp32 as version 1 and
the accepted recipes after it, each version's model hard-linked (or copied) from the cache,
and a config.pbtxt that records each version's label; written in one rename."""

from __future__ import annotations

import shutil
from pathlib import Path

from google.protobuf import text_format

from common import model_keys, paths
from common.model_config import config_text as write_config
from protos import model_config_pb2 as mc
from quantize import pipeline
from quantize.pipeline import FP32, MODEL_FILE, TOKENIZER_FILE, Source
from quantize.recipes import DECODER


def config_text(model: Source, versions: dict[int, str]) -> str:
    if model.kind == DECODER:
        return llm_config_text(model, versions)
    params = {
        **model.config,
        model_keys.TOKENIZER: TOKENIZER_FILE,
        **{f"meshserve.version.{v}": label for v, label in versions.items()},
    }
    return write_config(
        model.name,
        model.max_batch_size,
        model.max_queue_delay_us,
        params,
        all_versions=True,
        platform="onnxruntime_onnx",
    )


def llm_config_text(model: Source, versions: dict[int, str]) -> str:
    """A decoder as the LLM engine serves it: decoupled, Triton's vLLM-backend tensors
    (completed by the worker), no batch dimension (the engine batches sequences)."""
    config = mc.ModelConfig(name=model.name, platform="onnxruntime_onnx", max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    if len(versions) > 1:
        config.version_policy.all.SetInParent()
    params = {
        **model.config,
        model_keys.TOKENIZER: TOKENIZER_FILE,
        **{f"meshserve.version.{v}": label for v, label in versions.items()},
    }
    for key, value in params.items():
        config.parameters[key].string_value = value
    return text_format.MessageToString(config)


def install_model(name: str, accepted: list[str], cache: Path, output: Path) -> dict[int, str]:
    """Write OUTPUT/<name>/ (fp32 as version 1, accepted recipes after it) in one rename."""
    model = pipeline.source(name)
    versions = {1: FP32, **{i + 2: r for i, r in enumerate(accepted)}}

    def write(tmp: Path) -> None:
        shutil.copy(pipeline.artifact_for(cache, name, FP32).tokenizer, tmp / TOKENIZER_FILE)
        for version, label in versions.items():
            (tmp / str(version)).mkdir()
            src = pipeline.artifact_for(cache, name, label).model
            paths.link_or_copy(src, tmp / str(version) / MODEL_FILE)
        (tmp / "config.pbtxt").write_text(config_text(model, versions))

    pipeline._staged(output / name, write)
    return versions


def installed_versions(output: Path, name: str) -> dict[int, str]:
    """{version: label} of OUTPUT/<name>/ as its config.pbtxt records them; {} if absent."""
    path = output / name / "config.pbtxt"
    if not path.exists():
        return {}
    config = text_format.Parse(path.read_text(), mc.ModelConfig())
    prefix = model_keys.VERSION_LABEL
    return {
        int(k.removeprefix(prefix)): v.string_value
        for k, v in config.parameters.items()
        if k.startswith(prefix)
    }


def add_versions(name: str, labels: list[str], cache: Path, output: Path) -> dict[int, str]:
    """OUTPUT/<name>/ with `labels` as further versions after those it already has (one
    rename, as install_model); nothing is written when `labels` adds nothing."""
    have = installed_versions(output, name)
    new = [label for label in labels if label not in have.values()]
    if have and not new:
        return have
    keep = [have[v] for v in sorted(have) if have[v] != FP32]
    for label in keep:
        if not pipeline.artifact_for(cache, name, label).exists():
            raise pipeline.BuildError(
                f"{output / name} has version {label!r}, which is not in the cache {cache}; "
                "rebuild it there (python -m quantize build-repository) or choose another "
                "--output"
            )
    return install_model(name, keep + new, cache, output)
