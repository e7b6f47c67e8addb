"""The embedding table as 8-bit blocks (quantize/embedding.py), run by onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantize import gguf_blocks
from quantize.embedding import (
    EmbeddingError,
    dequantize_table,
    gather_from_gguf,
    quantize_gathers,
    quantize_table,
)
from tests.quantize.test_gguf_blocks import raw_blocks, values, write_gguf
from worker.runtime import index_bounds


def _gather_model(table: np.ndarray, shared: bool = False, name: str = "table") -> onnx.ModelProto:
    nodes = [helper.make_node("Gather", [name, "ids"], ["rows"])]
    outputs = [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None)]
    if shared:  # the same table read by another node too: left as it is
        nodes.append(helper.make_node("Identity", [name], ["copy"]))
        outputs.append(helper.make_tensor_value_info("copy", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows", "new"])],
        outputs,
        [numpy_helper.from_array(table, name)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_a_q8_0_table_gets_its_own_codes_back() -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(64, 96))
    q[:, ::32] = 127  # each block of 32 reaches the grid's end, as Q8_0's d = amax / 127 does
    d = rng.uniform(1e-3, 2e-2, size=(64, 3)).astype(np.float16).astype(np.float32)
    w = (q.reshape(64, 3, 32) * d[..., None]).reshape(64, 96).astype(np.float32)
    codes, scales = quantize_table(w)
    assert codes.dtype == np.uint8 and scales.shape == (64, 3)
    assert np.array_equal(codes.astype(np.int16) - 128, q)
    np.testing.assert_allclose(dequantize_table(codes, scales), w, rtol=1e-6, atol=0)


def test_the_rewritten_gather_runs_in_onnxruntime_a_quarter_the_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((500, 64)).astype(np.float32)
    model = _gather_model(table)
    (done,) = quantize_gathers(model)
    assert done.name == "table" and done.shape == (500, 64)
    assert done.bytes_after < done.bytes_before / 3.5
    assert [n.op_type for n in model.graph.node] == ["GatherBlockQuantized"]
    assert {t.name for t in model.graph.initializer} == {"table.q8", "table.scales"}
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    ids = np.array([[0, 7, 499], [3, 3, 250]], np.int64)
    (rows,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids}
    )
    assert rows.shape == (2, 3, 64)
    # within half a step of each block's grid, and exactly what the codes say
    step = np.abs(table).reshape(500, 2, 32).max(-1).repeat(32, axis=1) / 127
    assert np.all(np.abs(rows - table[ids]) <= step[ids] / 2 + 1e-6)
    assert done.max_abs_error <= float(step.max()) / 2 + 1e-6
    # the worker still knows the table's rows, so an id past the end is refused up front
    assert index_bounds(path) == {"ids": 500}


def test_a_shared_or_misshapen_table_is_left_alone() -> None:
    table = np.ones((10, 64), np.float32)
    assert quantize_gathers(_gather_model(table, shared=True)) == []
    assert quantize_gathers(_gather_model(np.ones((10, 48), np.float32))) == []
    assert quantize_gathers(_gather_model(table.astype(np.float16))) == []


SYMMETRIC = {"Q8_0": 32, "Q4_0": 32, "Q5_0": 32, "IQ4_NL": 32, "Q3_K": 16, "Q6_K": 16}


@pytest.mark.parametrize("kind", sorted(gguf_blocks.LAYOUTS))
def test_a_gguf_table_keeps_its_own_codes_where_its_blocks_are_symmetric(
    kind: str, tmp_path: Path
) -> None:
    """A served checkpoint's embedding (quantize/llm.py): a symmetric block type becomes
    8-bit GatherBlockQuantized over the file's codes, bit for bit; an affine one stays fp32."""
    raw = raw_blocks(kind, 40, 512)
    table = values(kind, raw, 512)
    path = write_gguf(tmp_path / f"{kind}.gguf", {"token_embd.weight": (kind, raw)})
    model = _gather_model(table, name="embed.weight")
    done = gather_from_gguf(model, path)
    ops = [n.op_type for n in model.graph.node]
    if kind not in SYMMETRIC:
        assert done == [] and ops == ["Gather"]
        return
    assert ops == ["GatherBlockQuantized"] and done[0].max_abs_error == 0.0
    attrs = {a.name: a.i for a in model.graph.node[0].attribute}
    assert (attrs["bits"], attrs["block_size"]) == (8, SYMMETRIC[kind])
    assert done[0].bytes_after < done[0].bytes_before / 3
    onnx.save(model, str(tmp_path / "model.onnx"))
    ids = np.array([[0, 39, 7], [5, 5, 20]], np.int64)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    (rows,) = session.run(None, {"ids": ids})
    np.testing.assert_array_equal(rows, table[ids])


def test_a_table_the_file_does_not_hold_is_refused_by_name(tmp_path: Path) -> None:
    raw = raw_blocks("Q8_0", 8, 64)
    path = write_gguf(tmp_path / "q8.gguf", {"token_embd.weight": ("Q8_0", raw)})
    model = _gather_model(values("Q8_0", raw, 64) * 1.5, name="embed.weight")
    with pytest.raises(EmbeddingError, match=r"embed.weight \(Q8_0 token_embd.weight\)"):
        gather_from_gguf(model, path)
