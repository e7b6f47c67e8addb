"""The token embedding as 8-bit blocks: onnxruntime's com.microsoft GatherBlockQuantized.

The step graph's embedding is a Gather over an fp32 table [vocab, hidden]: for SmolLM2
49,152 x 576 floats, 113 MB of a 267 MB int8 model, while every row a step reads is a few
KB. The weight-only recipes quantize the MatMuls only (onnxruntime's MatMulNBits has no
Gather), so the table stays fp32. This rewrites it as uint8 codes in blocks of `block_size`
along the hidden dimension with one fp32 scale each, symmetric (codes q + 128, the default
zero point of 8-bit GatherBlockQuantized): a quarter of the bytes plus 1/`block_size` of
scales. A table that was GGUF Q8_0 (d * q, q in -127..127, blocks of 32, as SmolLM2's tied
embedding is) gets the very same codes back: the round trip is exact up to fp32 rounding.

A checkpoint served as stored (quantize/llm.py) takes the table's codes from its GGUF
instead (`gather_from_gguf`): a symmetric block type (Q8_0, Q4_0, Q5_0, IQ4_NL, Q3_K in
blocks of 16, Q6_K in blocks of 16) becomes 8-bit codes q - z + 128 over the file's own
scales, bit for bit; an affine one (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K: w = s*q - m, which
GatherBlockQuantized cannot hold) leaves the table fp32. So does a GPU's build
(`build-llm --no-custom-op`): onnxruntime's CUDA GatherBlockQuantized (fp32 scales in its
recent sources) has not been run on our GPU path, and a node left on the CPU would keep the
step off CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from quantize import gguf_blocks
from quantize.gguf_index import gguf_index, gguf_names

MS_DOMAIN = "com.microsoft"
BLOCK = 32


class EmbeddingError(ValueError):
    """A GGUF table whose file codes do not reproduce the values the graph holds."""


@dataclass(frozen=True)
class Quantized:
    """One table rewritten: its name, shape, the largest absolute error, bytes before/after."""

    name: str
    shape: tuple[int, ...]
    max_abs_error: float
    bytes_before: int
    bytes_after: int


def quantize_table(w: np.ndarray, block_size: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [rows, cols], scales fp32 [rows, cols / block_size]) with
    w ~= scales * (codes - 128) per block."""
    rows, cols = w.shape
    blocks = w.astype(np.float32).reshape(rows, cols // block_size, block_size)
    scales = np.abs(blocks).max(axis=-1) / 127.0
    safe = np.where(scales == 0, 1.0, scales)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int16)
    return (q + 128).astype(np.uint8).reshape(rows, cols), scales.astype(np.float32)


def dequantize_table(codes: np.ndarray, scales: np.ndarray, block_size: int = BLOCK) -> np.ndarray:
    rows, cols = codes.shape
    q = codes.astype(np.float32).reshape(rows, cols // block_size, block_size) - 128.0
    return (q * scales[..., None]).reshape(rows, cols)


def quantize_gathers(model: onnx.ModelProto, block_size: int = BLOCK) -> list[Quantized]:
    """Rewrite, in place, every Gather of `model`'s main graph over a 2-D fp32 initializer
    (axis 0, hidden a multiple of `block_size`, used by nothing else) as GatherBlockQuantized
    of 8-bit blocks; returns what each table became. Other Gathers are left alone."""
    done: list[Quantized] = []
    for i, node, table in _tables(model):
        if table.dims[1] % block_size:
            continue
        w = numpy_helper.to_array(table)
        codes, scales = quantize_table(w, block_size)
        done.append(_rewrite(model, i, node, table, w, codes, scales, block_size))
    return done


def gather_from_gguf(model: onnx.ModelProto, gguf_path: Path) -> list[Quantized]:
    """Rewrite, in place, every table Gather of `model` named after a GGUF tensor of a
    symmetric block type as GatherBlockQuantized over the file's own codes and scales
    (module docstring); returns what each table became. A table whose type is affine, or
    not a block type, is left fp32; one the file's codes do not reproduce is an error."""
    index = gguf_index(gguf_path)
    done: list[Quantized] = []
    for i, node, table in _tables(model):
        names = gguf_names(table.name)
        t = index.get(names[0]) if len(names) == 1 else None
        if t is None or t.kind not in gguf_blocks.LAYOUTS:
            continue
        blocks = gguf_blocks.decode(t.kind, t.raw(gguf_path), t.shape[1])
        if blocks.residual is not None:
            continue
        zp = 2 ** (blocks.bits - 1) if blocks.zero_points is None else blocks.zero_points[..., None]
        codes = (blocks.codes.astype(np.int16) - zp + 128).astype(np.uint8)
        rows = codes.shape[0]
        w = numpy_helper.to_array(table)
        q = _rewrite(model, i, node, table, w, codes.reshape(rows, -1), blocks.scales, blocks.block)
        if q.max_abs_error > 2.0**-20 * float(np.abs(w).max()):  # a few fp32 ulps
            raise EmbeddingError(
                f"{table.name} ({t.kind} {names[0]}): the file's codes reproduce its values "
                f"only to {q.max_abs_error:.3g}"
            )
        done.append(q)
    return done


def _tables(model: onnx.ModelProto) -> list[tuple[int, onnx.NodeProto, onnx.TensorProto]]:
    """(index, node, table) of every Gather in the main graph over a 2-D fp32 initializer
    along axis 0 that nothing else uses."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    out = []
    for i, node in enumerate(graph.node):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        table = inits.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if (
            table is not None
            and uses[table.name] == 1
            and table.data_type == onnx.TensorProto.FLOAT
            and len(table.dims) == 2
            and axis in (0, -2)
        ):
            out.append((i, node, table))
    return out


def _rewrite(
    model: onnx.ModelProto,
    i: int,
    node: onnx.NodeProto,
    table: onnx.TensorProto,
    w: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    block_size: int,
) -> Quantized:
    """Node i (a Gather over `table`, values `w`) replaced at its index by
    GatherBlockQuantized over 8-bit `codes` and fp32 `scales`; the table's initializer by
    theirs."""
    graph = model.graph
    code_init = numpy_helper.from_array(codes, table.name + ".q8")
    scale_init = numpy_helper.from_array(scales.astype(np.float32), table.name + ".scales")
    graph.node.remove(node)
    graph.node.insert(
        i,
        helper.make_node(
            "GatherBlockQuantized",
            [code_init.name, node.input[1], scale_init.name],
            list(node.output),
            name=(node.name or table.name) + ".q8",
            domain=MS_DOMAIN,
            gather_axis=0,
            quantize_axis=1,
            block_size=block_size,
            bits=8,
        ),
    )
    graph.initializer.remove(table)
    graph.initializer.extend([code_init, scale_init])
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    error = float(np.abs(dequantize_table(codes, scales.astype(np.float32), block_size) - w).max())
    return Quantized(table.name, tuple(w.shape), error, w.nbytes, codes.nbytes + scales.nbytes)
