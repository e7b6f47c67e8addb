"""The token embedding as 8-bit blocks: onnxruntime's com.microsoft GatherBlockQuantized.

The step graph's embedding is a Gather over an fp32 table [vocab, hidden]: for SmolLM2
49,152 x 576 floats, 113 MB of a 267 MB int8 model, while every row a step reads is a few
KB. The weight-only recipes quantize the MatMuls only (onnxruntime's MatMulNBits has no
Gather), so the table stays fp32. This rewrites it as uint8 codes in blocks of `block_size`
along the hidden dimension with one fp32 scale each, symmetric (codes q + 128, the default
zero point of 8-bit GatherBlockQuantized): a quarter of the bytes plus 1/`block_size` of
scales. A table that was GGUF Q8_0 (d * q, q in -127..127, blocks of 32, as SmolLM2's tied
embedding is) gets the very same codes back: the round trip is exact up to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"
BLOCK = 32


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
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    done: list[Quantized] = []
    for i, node in enumerate(list(graph.node)):  # a node is replaced at its index
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        table = inits.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if (
            table is None
            or uses[table.name] != 1
            or table.data_type != onnx.TensorProto.FLOAT
            or len(table.dims) != 2
            or axis not in (0, -2)
            or table.dims[1] % block_size
        ):
            continue
        w = numpy_helper.to_array(table)
        codes, scales = quantize_table(w, block_size)
        code_init = numpy_helper.from_array(codes, table.name + ".q8")
        scale_init = numpy_helper.from_array(scales, table.name + ".scales")
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
        error = float(np.abs(dequantize_table(codes, scales, block_size) - w).max())
        after = codes.nbytes + scales.nbytes
        done.append(Quantized(table.name, tuple(w.shape), error, w.nbytes, after))
    if done and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return done
