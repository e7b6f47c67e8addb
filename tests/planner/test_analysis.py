"""Model analysis from the graph alone: parameters, bytes, FLOPs, KV bytes per token."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from perfmodel.analysis import (
    DECODER,
    ENCODER,
    GENERIC,
    AnalysisError,
    analyse_file,
    analyse_repository,
)
from quantize import encoder_graph
from quantize.models import BertEncoder, EncoderConfig
from quantize.recipes import RECIPES
from tests.planner.conftest import TINY


def test_mlp_flops_and_bytes_follow_the_weights(mlp_path: Path) -> None:
    a = analyse_file(mlp_path, "mlp", "1")
    params = 16 * 64 + 64 * 4
    assert a.kind == GENERIC and a.recipe == "fp32"
    assert a.projection_params == params
    assert a.weight_bytes == a.projection_bytes == 4 * params
    flops, moved = a.run(8)
    assert flops == 2 * params * 8  # one row per item
    assert moved == 4 * params + 8 * 4 * 4  # weights once + the [8, 4] fp32 output
    # Batching reads the weights once for more rows: intensity rises with the batch.
    assert a.intensity(1) < a.intensity(8) < a.intensity(64)


def test_int8_recipe_quarters_the_projection_bytes(wide_paths: tuple[Path, Path]) -> None:
    fp32, int8 = (analyse_file(p, "wide", "1") for p in wide_paths)
    assert int8.recipe == "int8-dynamic" and int8.compute_dtype("cpu") == "int8"
    assert int8.projection_params == fp32.projection_params
    assert int8.projection_bytes == pytest.approx(fp32.projection_bytes / 4, rel=0.02)
    # The prediction for a recipe the repository lacks agrees with the built artifact.
    predicted = fp32.as_recipe("encoder-int8-dynamic")
    assert predicted.projection_bytes == pytest.approx(int8.projection_bytes, rel=0.02)


def test_decoder_kv_bytes_and_decode_cost(tiny_llm_path: Path) -> None:
    a = analyse_file(tiny_llm_path, "tiny", "1")
    head_dim = TINY.hidden // TINY.heads
    assert a.kind == DECODER and a.layers == TINY.layers and a.kv_heads == TINY.kv_heads
    assert a.kv_bytes_per_token == 2 * TINY.layers * TINY.kv_heads * head_dim * 4
    per_layer = 2 * TINY.hidden * TINY.hidden + 2 * TINY.hidden * TINY.kv_heads * head_dim
    per_layer += 3 * TINY.hidden * TINY.intermediate
    assert a.projection_params == TINY.layers * per_layer + TINY.hidden * TINY.vocab_size
    # One more cached token per sequence reads its keys and values once more per row.
    f0, b0 = a.decode_step(4, 100)
    f1, b1 = a.decode_step(4, 101)
    assert b1 - b0 == 4 * a.kv_bytes_per_token
    assert f1 - f0 == 4 * 4 * a.attention_width * a.layers
    # A prompt's LM head sees its last position only.
    fp, _ = a.prefill(10)
    body = a.projection_params - a.head_params
    assert fp == 2 * (body * 10 + a.head_params) + 2 * 100 * a.attention_width * a.layers


def test_repository_versions_and_bad_input(tmp_path: Path, mlp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(mlp_path.read_bytes())
    (tmp_path / "m" / "config.pbtxt").write_text(
        'max_batch_size: 8\nparameters { key: "meshserve.version.1" '
        'value { string_value: "my-recipe" } }\n'
    )
    (found,) = analyse_repository(tmp_path)
    assert (found.name, found.version, found.recipe, found.max_batch_size) == (
        "m",
        "1",
        "my-recipe",
        8,
    )
    (tmp_path / "bad" / "1").mkdir(parents=True)
    (tmp_path / "bad" / "1" / "model.onnx").write_bytes(b"not onnx")
    with pytest.raises(AnalysisError, match="not a readable ONNX model"):
        analyse_repository(tmp_path)
    with pytest.raises(AnalysisError, match="no such model repository"):
        analyse_repository(tmp_path / "missing")


def test_unknown_recipe_is_named(mlp_path: Path) -> None:
    with pytest.raises(AnalysisError, match="unknown recipe 'int3'.*known recipes"):
        analyse_file(mlp_path, "mlp", "1").as_recipe("int3")


def test_graph_facts_are_read_not_run(tiny_llm_path: Path) -> None:
    # The analysis needs only the graph: metadata props carry the shape facts.
    meta = {p.key for p in onnx.load(str(tiny_llm_path)).metadata_props}
    assert "meshserve.llm.layers" in meta


def test_fused_encoder_graph_counts_its_attention(tmp_path: Path) -> None:
    """The encoder graph's q/k/v projection lives inside Attention (QAttention once int8):
    its weights count as projections, and each Attention op is a layer."""
    config = EncoderConfig(vocab_size=128, hidden=64, layers=3, heads=4, intermediate=256)
    torch.manual_seed(0)
    fp32 = encoder_graph.save(encoder_graph.build(BertEncoder(config)), tmp_path / "fp32.onnx")
    RECIPES["encoder-int8-dynamic"].apply(fp32, tmp_path / "int8.onnx")
    params = config.layers * (4 * config.hidden**2 + 2 * config.hidden * config.intermediate)
    for path in (fp32, tmp_path / "int8.onnx"):
        a = analyse_file(path, "encoder", "1")
        assert a.kind == ENCODER and a.layers == config.layers
        assert a.projection_params == params
        assert a.attention_width == config.hidden
        assert a.table_row_bytes == 2 * config.hidden * 4  # a word row and a position row
    assert analyse_file(tmp_path / "int8.onnx", "encoder", "1").compute_dtype("cpu") == "int8"
