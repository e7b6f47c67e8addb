"""Graphs the planner reads: the toy MLP, an int8 copy of a wider one, and a tiny LLM step
graph (the engine's own builder, random weights)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from onnx import helper

from devmesh import toy_models
from quantize import llm_graph
from quantize.models import DecoderConfig, LlamaDecoder
from quantize.recipes import RECIPES

TINY = DecoderConfig(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def save_graph(graph: onnx.GraphProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="session")
def mlp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_graph(toy_models.mlp(), tmp_path_factory.mktemp("mlp") / "model.onnx")


@pytest.fixture(scope="session")
def wide_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(fp32, int8 dynamic) of a 256 -> 512 -> 16 MLP."""
    root = tmp_path_factory.mktemp("wide")
    fp32 = save_graph(toy_models.mlp(hidden=512, features=256, classes=16), root / "fp32.onnx")
    RECIPES["encoder-int8-dynamic"].apply(fp32, root / "int8.onnx")
    return fp32, root / "int8.onnx"


@pytest.fixture(scope="session")
def tiny_llm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = LlamaDecoder(TINY).eval()
    path = tmp_path_factory.mktemp("tiny-llm") / "model.onnx"
    return llm_graph.save(llm_graph.build(model, 256), path)
