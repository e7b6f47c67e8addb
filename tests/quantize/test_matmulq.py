"""meshserve's MatMulQ (kernels/matmul_q.cc, common/custom_ops.py): a GGUF's blocks served at
their own bits. Real onnxruntime sessions with the built library, each kernel the CPU has
(AVX-512 VNNI, AVX2, plain C++), code width (4, 5, 6, 8 bits) and block (16, 32) checked
against the same arithmetic in numpy, and quantize_matmuls choosing the op for every GGUF
block type."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from common import cpu, custom_ops
from quantize import int4
from tests.quantize.test_gguf_blocks import graph, raw_blocks, values, write_gguf

RNG = np.random.default_rng(5)
FLAGS = cpu.flags()
ISAS = ["scalar"]
ISAS += ["avx2"] if {"avx2", "fma", "f16c"} <= FLAGS else []
ISAS += ["avx512"] if {"avx512_vnni", "avx512bw", "avx512vl"} <= FLAGS else []

pytestmark = pytest.mark.skipif(
    not custom_ops.available(), reason="`make ops` (which `make test` runs) builds the library"
)


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    os.environ["MESHSERVE_OPS_ISA"] = request.param
    yield request.param
    del os.environ["MESHSERVE_OPS_ISA"]


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    custom_ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def q_model(
    k: int,
    n: int,
    bits: int,
    codes: np.ndarray,
    scales: np.ndarray,
    zp: np.ndarray | None,
    bias: np.ndarray | None = None,
) -> onnx.ModelProto:
    records, scales, zp, bias = custom_ops.pack(codes, scales, zp, bits, bias)
    inits = [numpy_helper.from_array(records, "codes"), numpy_helper.from_array(scales, "scales")]
    names = [
        "x",
        "codes",
        "scales",
        "zp" if zp is not None else "",
        "bias" if bias is not None else "",
    ]
    inits += [
        numpy_helper.from_array(a, name)
        for a, name in ((zp, "zp"), (bias, "bias"))
        if a is not None
    ]
    node = helper.make_node(
        custom_ops.MATMUL_Q,
        names[: max(i for i, name in enumerate(names) if name) + 1],
        ["y"],
        domain=custom_ops.DOMAIN,
        K=k,
        N=n,
        bits=bits,
        block_size=codes.shape[-1],
    )
    g = helper.make_graph(
        [node],
        "matmulq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(custom_ops.DOMAIN, 1)]
    return helper.make_model(g, opset_imports=opsets, ir_version=10)


def reference(
    x: np.ndarray,
    bits: int,
    codes: np.ndarray,
    scales: np.ndarray,
    zp: np.ndarray | None,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """The op's arithmetic in numpy: x in blocks of 32 as llama.cpp's Q8_0 (d = amax / 127
    held in fp16, codes rounded to nearest even), int dot products per weight block, the
    zero point and bias against x's block sums d * sum(q), float64 sums."""
    rows = x.reshape(-1, x.shape[-1])
    n, nb, block = codes.shape
    xb = rows.reshape(len(rows), -1, 32)
    d = np.abs(xb).max(-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(xb * inv[..., None]).astype(np.int64).reshape(len(rows), nb, block)
    dx = np.repeat(d.astype(np.float16).astype(np.float64), 32 // block, axis=1)  # [M, nb]
    zero = np.full((n, nb), 1 << (bits - 1)) if zp is None else zp.astype(np.int64)
    dots = np.einsum("mbk,nbk->mnb", q, codes.astype(np.int64)) - zero[None] * q.sum(-1)[:, None]
    y = dots * scales.astype(np.float64)[None] * dx[:, None]
    if bias is not None:
        y += bias.astype(np.float64)[None] * (dx * q.sum(-1))[:, None]
    return y.sum(-1).reshape(*x.shape[:-1], n)


@pytest.mark.parametrize("block", custom_ops.BLOCK_SIZES)
@pytest.mark.parametrize("bits", custom_ops.BITS)
@pytest.mark.parametrize(
    ("shape", "k", "n", "half", "affine"),
    [
        ((1, 1), 64, 16, True, False),  # one row, one group
        ((2, 3), 96, 40, False, True),  # a partial last group, fp32 scales, zero points, bias
        ((1, 17), 896, 136, True, False),  # rows past the kernels' row tiles (8 and 4)
        ((2, 35), 256, 32, False, True),  # two tiles of rows (64)
        ((3, 3), 4864, 48, False, True),
    ],
)
def test_each_kernel_computes_the_blocks_arithmetic(
    isa: str,
    bits: int,
    block: int,
    shape: tuple[int, int],
    k: int,
    n: int,
    half: bool,
    affine: bool,
) -> None:
    nb = k // block
    codes = RNG.integers(0, 1 << bits, (n, nb, block), dtype=np.uint8)
    codes[0, 0] = (1 << bits) - 1  # the extremes: 8-bit codes far from x's sign (AVX2's
    codes[0, 1] = 0  # vpmaddubsw pairs must not saturate)
    scales = (RNG.random((n, nb)) * 0.01).astype(np.float16 if half else np.float32)
    zp = RNG.integers(0, 1 << bits, (n, nb), dtype=np.uint8) if affine else None
    bias = (RNG.standard_normal((n, nb)) * 0.01).astype(np.float32) if affine else None
    x = RNG.standard_normal((*shape, k)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    x[-1, -1, 32:64] = -np.abs(x[-1, -1, 32:64])  # codes 0 x -127: the int16 pairs' bound
    (y,) = session(q_model(k, n, bits, codes, scales, zp, bias)).run(None, {"x": x})
    want = reference(x, bits, codes, scales, zp, bias)
    assert y.shape == (*shape, n)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


def test_bad_input_is_refused_by_name_and_the_session_keeps_serving() -> None:
    codes = RNG.integers(0, 32, (16, 2, 32), dtype=np.uint8)
    scales = np.full((16, 2), 0.01, np.float16)
    model = q_model(64, 16, 5, codes, scales, None)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "K"  # the op checks it
    s = session(model)
    with pytest.raises(Exception, match="last dimension must be K = 64"):
        s.run(None, {"x": np.zeros((1, 1, 65), np.float32)})
    x = RNG.standard_normal((1, 1, 64)).astype(np.float32)
    want = reference(x, 5, codes, scales, None)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], want, 1e-5)


@pytest.mark.parametrize(
    ("kind", "bits", "block"),
    [
        ("Q5_0", 5, 32),
        ("Q5_1", 5, 32),
        ("Q5_K", 5, 32),
        ("Q4_K", 4, 32),
        ("IQ4_NL", 8, 32),
        ("Q6_K", 6, 16),
        ("Q3_K", 4, 16),
        ("Q2_K", 4, 16),
    ],  # as read from the file
)
def test_a_file_tensor_becomes_matmulq_over_its_codes(
    kind: str, bits: int, block: int, tmp_path: Path
) -> None:
    raw = raw_blocks(kind, 48, 512)
    w = values(kind, raw, 512).T.copy()  # [in, out]
    path = write_gguf(tmp_path / f"{kind}.gguf", {"blk.0.ffn_up.weight": (kind, raw)})
    model = graph({"layers.0.up.weight": w})
    report = int4.quantize_matmuls(model, gguf_path=path, accuracy_level=4, custom_op=True)
    assert report.entries[0].codec.endswith(int4.OP)
    assert report.entries[0].max_abs_error <= 2.0**-20 * np.abs(w).max()
    (node,) = [n for n in model.graph.node if n.op_type not in ("Transpose", "Identity")]
    assert node.op_type == custom_ops.MATMUL_Q  # an affine block's residual is its bias
    attrs = {a.name: a.i for a in node.attribute}
    assert (attrs["bits"], attrs["block_size"]) == (bits, block)
    inits = {i.name.rsplit("_", 1)[-1]: i for i in model.graph.initializer}
    assert 8 * len(inits[f"Q{bits}"].raw_data) / w.size == bits  # bits a weight, and scales:
    half = TensorProto.FLOAT if kind.endswith("_K") else TensorProto.FLOAT16  # d x sc: fp32
    assert inits["scales"].data_type == half
    x = RNG.standard_normal((2, 3, 512)).astype(np.float32)
    (y,) = session(model).run(None, {"x": x})
    # int8 activations per block, as llama.cpp's own dot products: within ~1% of exact
    assert np.abs(y - x @ w).max() <= 0.02 * np.abs(x @ w).max()


def test_without_the_op_a_graph_keeps_matmulnbits(tmp_path: Path) -> None:
    """custom_op=False (a GPU's build, `--no-custom-op`): onnxruntime's own op, no domain."""
    raw = raw_blocks("Q6_K", 16, 256)
    path = write_gguf(tmp_path / "q6k.gguf", {"blk.1.ffn_down.weight": ("Q6_K", raw)})
    model = graph({"layers.1.down.weight": values("Q6_K", raw, 256).T.copy()})
    report = int4.quantize_matmuls(model, gguf_path=path, accuracy_level=4, custom_op=False)
    assert [e.codec for e in report.entries] == ["q6_k-exact"]
    assert "MatMulNBits" in {n.op_type for n in model.graph.node}
    assert not custom_ops.uses_custom_ops(model)


def test_a_fused_weight_of_5_and_8_bit_parts_is_one_8_bit_matmulq(tmp_path: Path) -> None:
    """q/k/v of Qwen2.5-0.5B's Q4_K_M file: Q5_0 q and k, a Q8_0 v."""
    tensors = {
        "blk.1.ffn_gate.weight": ("Q5_0", raw_blocks("Q5_0", 32, 256)),
        "blk.1.ffn_up.weight": ("Q8_0", raw_blocks("Q8_0", 32, 256)),
    }
    path = write_gguf(tmp_path / "mixed.gguf", tensors)
    w = np.concatenate([values(k, raw, 256) for k, raw in tensors.values()]).T.copy()
    model = graph({"layers.1.gate_up.weight": w})
    report = int4.quantize_matmuls(model, gguf_path=path, accuracy_level=4, custom_op=True)
    assert [e.codec for e in report.entries] == [f"q5_0+q8_0-exact{int4.OP}"]
    (node,) = [n for n in model.graph.node if n.op_type == custom_ops.MATMUL_Q]
    assert {a.name: a.i for a in node.attribute}["bits"] == 8
    x = RNG.standard_normal((1, 2, 256)).astype(np.float32)
    (y,) = session(model).run(None, {"x": x})
    assert np.abs(y - x @ w).max() <= 0.02 * np.abs(x @ w).max()
