"""Config completion from real ONNX graphs, and the checks on config.pbtxt."""

from __future__ import annotations

from pathlib import Path

import pytest

from devmesh import toy_models
from protos import model_config_pb2 as mc
from worker import config as cfg
from worker.runtime import CPU, OnnxSession, RuntimeOptions


def load(tmp_path: Path, graph, text: str | None):  # type: ignore[no-untyped-def]
    model_dir = tmp_path / "m"
    toy_models.write(model_dir, graph, text)
    session = OnnxSession(model_dir / "1" / "model.onnx", RuntimeOptions(providers="cpu"), [CPU])
    config = cfg.read(model_dir)
    return cfg.complete(config, session.inputs, session.outputs, 32, 100)


def test_completes_from_graph_without_config(tmp_path: Path) -> None:
    config = load(tmp_path, toy_models.add_sub(), None)
    assert config.max_batch_size == 32
    assert [(t.name, list(t.dims), t.data_type) for t in config.input] == [
        ("INPUT0", [16], mc.TYPE_INT32),
        ("INPUT1", [16], mc.TYPE_INT32),
    ]
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 100
    spec = cfg.spec(config, "1")
    assert spec.dynamic_batching and spec.max_batch_size == 32


def test_fixed_shape_model_does_not_batch(tmp_path: Path) -> None:
    config = load(tmp_path, toy_models.fixed(), None)
    assert config.max_batch_size == 0
    assert list(config.input[0].dims) == [2, 3]
    assert not cfg.spec(config, "1").dynamic_batching


def test_dynamic_dims_become_minus_one(tmp_path: Path) -> None:
    config = load(tmp_path, toy_models.identity("BYTES"), None)
    assert list(config.input[0].dims) == [-1]
    assert config.input[0].data_type == mc.TYPE_STRING


def test_config_values_are_kept(tmp_path: Path) -> None:
    config = load(tmp_path, toy_models.mlp(), toy_models.MLP_CONFIG)
    assert config.max_batch_size == 64
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert config.parameters[cfg.PRICE_PER_CALL].string_value == "100"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'max_batch_size: 8\ninput { name: "INPUT0" data_type: TYPE_INT32 dims: [16] }',
            "config input 'INPUT0' is INT32, the ONNX graph has FP32",
        ),
        (
            'max_batch_size: 8\ninput { name: "INPUT0" data_type: TYPE_FP32 dims: [15] }',
            "has dims [15], the ONNX graph has [16]",
        ),
        (
            'max_batch_size: 8\ninput { name: "features" data_type: TYPE_FP32 dims: [16] }',
            "config input 'features' is not in the ONNX graph",
        ),
        (
            'parameters { key: "meshserve.price_per_call_micro_usd" value { string_value: "-5" } }',
            "must be a non-negative integer",
        ),
        (
            'parameters { key: "meshserve.price_per_1k_output_tokens_micro_usd" '
            'value { string_value: "0.2" } }',
            "price_per_1k_output_tokens_micro_usd must be a non-negative integer",
        ),
        (
            'parameters { key: "meshserve.batch_delay_when_idle" value { string_value: "yes" } }',
            "batch_delay_when_idle must be true or false, got 'yes'",
        ),
        ("max_batch_size: [", "not a valid ModelConfig"),
    ],
    ids=["datatype", "dims", "name", "price", "token-price", "delay-when-idle", "syntax"],
)
def test_bad_config_is_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(cfg.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load(tmp_path, toy_models.mlp(), text)


def test_batching_a_fixed_shape_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match="no dynamic first dimension"):
        load(tmp_path, toy_models.fixed(), "max_batch_size: 4")
