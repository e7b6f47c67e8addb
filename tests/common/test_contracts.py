"""The contract modules in common/: one spelling, and the formats both sides read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common import bytes_codec, model_keys, shard_format, step_graph
from common.errors import InvalidArgument


def test_bytes_codec_forms_agree() -> None:
    items = [b"", b"a", "h\u00e9llo".encode(), bytes(range(256))]
    raw = bytes_codec.join(items)
    assert bytes_codec.serialize_bytes(np.array(items, dtype=object)) == raw
    assert bytes_codec.split(raw) == items
    assert bytes_codec.deserialize_bytes(raw, len(items), "x").tolist() == items


def test_bytes_codec_refuses_a_short_payload_by_name() -> None:
    with pytest.raises(InvalidArgument, match="input 'text'"):
        bytes_codec.deserialize_bytes(bytes_codec.join([b"abc"])[:-1], 1, "text")


def test_model_keys_are_unique_and_namespaced() -> None:
    values = [v for k, v in vars(model_keys).items() if k.isupper() and isinstance(v, str)]
    assert len(values) == len(set(values))
    assert all(v.startswith("meshserve.") for v in values if v != model_keys.LLM_ENGINE)
    assert set(values) >= model_keys.PRIVATE


def test_step_graph_cache_names_pair_up() -> None:
    assert step_graph.past_names(3) == ("past_key.3", "past_value.3")
    assert step_graph.present_names(3) == ("present_key.3", "present_value.3")


def test_shard_checksum_is_the_files_sha256(tmp_path: Path) -> None:
    path = tmp_path / "seg.onnx"
    path.write_bytes(b"x" * (3 << 20))  # over one read chunk
    import hashlib

    assert shard_format.sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert shard_format.shard_dir(tmp_path, "2", 4) == tmp_path / "2" / "tp4"


def test_default_paths_follow_the_checkout_or_an_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from common import paths

    root = paths.source_root()
    assert root is not None and (root / "pyproject.toml").exists()  # tests run from a checkout
    monkeypatch.delenv("MESHSERVE_BUILD_DIR", raising=False)
    assert paths.build("models") == root / "build" / "models"
    monkeypatch.setenv("MESHSERVE_BUILD_DIR", str(tmp_path))
    assert paths.build("quantize", "reports") == tmp_path / "quantize" / "reports"
