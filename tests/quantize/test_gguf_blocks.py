"""quantize/gguf_blocks.py (with quantize/int4.py): every GGUF block type read from a file's
raw bytes becomes MatMulNBits over the file's own codes.

The reference is gguf-py's own dequantize of the same bytes. Tolerances stated: decoded
blocks reproduce it bit for bit for the types stored as-is (codes and one scale per block)
and to within a few fp32 ulps of the largest weight for the affine ones (zero point +
residual); a MatMulNBits graph computed in float (accuracy_level 0) matches x @ W to 1e-5
of |x @ W|. The blocks are random bytes (every byte pattern is a valid block) with sane
fp16 scales: the layouts are what is checked, whatever codes llama.cpp would pick.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_int4 import graph, rel_err, run

from quantize import gguf_blocks, int4
from quantize.checkpoint import unpermute_rope

RNG = np.random.default_rng(0)
# where each type keeps its fp16 scale (and min) in a block: set to sane values
FP16_AT = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
# (bits, block, stored as-is) of each type's MatMulNBits layout, as the module documents it
LAYOUT = {
    "Q8_0": (8, 32, True),
    "Q4_0": (4, 32, True),
    "Q4_1": (4, 32, False),
    "Q5_0": (8, 32, True),
    "Q5_1": (8, 32, False),
    "IQ4_NL": (8, 32, True),
    "Q2_K": (4, 16, False),
    "Q3_K": (4, 16, True),
    "Q4_K": (4, 32, False),
    "Q5_K": (8, 32, False),
    "Q6_K": (8, 16, True),
}
FROM_FILE = [k for k in gguf_blocks.LAYOUTS if k not in ("Q8_0", "Q4_0", "Q4_1")]


def raw_blocks(kind: str, rows: int, cols: int, scale: float = 0.01) -> np.ndarray:
    """Random bytes [rows, bytes per row] of `kind`, its fp16 fields ~N(0, scale)."""
    per, size, _ = gguf_blocks.LAYOUTS[kind]
    n = rows * cols // per
    b = RNG.integers(0, 256, (n, size), dtype=np.uint8)
    for at in FP16_AT[kind]:
        d = (RNG.standard_normal(n) * scale).astype(np.float16)
        b[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    return b.reshape(rows, -1)


def values(kind: str, raw: np.ndarray, cols: int) -> np.ndarray:
    return np.asarray(dequantize(raw, T[kind]), np.float32).reshape(raw.shape[0], cols)


def write_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    """A GGUF holding these raw tensors (name -> (type, bytes)), as llama.cpp writes them."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (kind, raw) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", list(gguf_blocks.LAYOUTS))
def test_decoded_blocks_reproduce_gguf_dequantize(kind: str) -> None:
    raw = raw_blocks(kind, 6, 512)
    want = values(kind, raw, 512)
    blocks = gguf_blocks.decode(kind, raw, 512)
    bits, block, as_is = LAYOUT[kind]
    assert (blocks.bits, blocks.block) == (bits, block)
    assert (blocks.residual is None) == as_is
    assert blocks.codes.max() < 2**bits
    got = blocks.dequantize().T
    if as_is:
        np.testing.assert_array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 2.0**-20 * np.abs(want).max()


@pytest.mark.parametrize("kind", FROM_FILE)
def test_a_file_tensor_becomes_matmulnbits_over_its_codes(kind: str, tmp_path: Path) -> None:
    raw = raw_blocks(kind, 40, 512)
    w = values(kind, raw, 512).T.copy()  # [in, out]
    path = write_gguf(tmp_path / f"{kind}.gguf", {"blk.0.ffn_up.weight": (kind, raw)})
    model = graph({"layers.0.up.weight": w})
    report = int4.quantize_matmuls(model, gguf_path=path, accuracy_level=0)
    onnx.checker.check_model(model)
    assert [e.codec for e in report.entries] == [f"{kind.lower()}-exact"]
    assert report.entries[0].max_abs_error <= 2.0**-20 * np.abs(w).max()
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: a.i for a in node.attribute}
    assert (attrs["bits"], attrs["block_size"]) == LAYOUT[kind][:2]
    assert ("MatMul" in {n.op_type for n in model.graph.node}) != LAYOUT[kind][2]  # residual
    x = RNG.standard_normal((2, 3, 512)).astype(np.float32)
    assert rel_err(run(model, x)[0], x @ w) < 1e-5


def test_a_fused_weight_of_mixed_types_is_reblocked_and_rope_rows_are_found(
    tmp_path: Path,
) -> None:
    """q/k/v of a Q4_K_M file: Q4_K, Q4_K and Q6_K, q and k rows in the step graph's
    rotate-half order (checkpoint.unpermute_rope), as one MatMulNBits of 8 bits, blocks of 16."""
    parts = {"attn_q": ("Q4_K", 64), "attn_k": ("Q4_K", 32), "attn_v": ("Q6_K", 32)}
    tensors = {f"blk.2.{n}.weight": (k, raw_blocks(k, rows, 256)) for n, (k, rows) in parts.items()}
    path = write_gguf(tmp_path / "qkv.gguf", tensors)
    rows = [values(k, raw, 256) for k, raw in tensors.values()]
    rows[0], rows[1] = unpermute_rope(rows[0], 4), unpermute_rope(rows[1], 2)
    w = np.concatenate(rows).T.copy()
    model = graph({"layers.2.qkv.weight": w})
    report = int4.quantize_matmuls(model, gguf_path=path, accuracy_level=0)
    assert [e.codec for e in report.entries] == ["q4_k+q6_k-exact"]
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: a.i for a in node.attribute}
    assert (attrs["bits"], attrs["block_size"]) == (8, 16)
    x = RNG.standard_normal((1, 5, 256)).astype(np.float32)
    assert rel_err(run(model, x)[0], x @ w) < 1e-5


def test_values_that_are_not_the_files_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    raw = raw_blocks("Q6_K", 8, 256)
    path = write_gguf(tmp_path / "x.gguf", {"blk.1.ffn_down.weight": ("Q6_K", raw)})
    w = values("Q6_K", raw, 256).T.copy()
    w[3, 5] += 1.0
    with pytest.raises(int4.QuantizeError, match=r"Q6_K blk\.1\.ffn_down\.weight.*not the"):
        int4.quantize_matmuls(graph({"layers.1.down.weight": w}), gguf_path=path)


def test_a_row_length_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="Q4_K: 144 bytes per row of 128 weights"):
        gguf_blocks.decode("Q4_K", raw_blocks("Q4_K", 2, 256), 128)
