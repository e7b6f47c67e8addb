"""meshserve's onnxruntime custom ops: where the library is, how a session loads it, and the
weight layout its MatMulQ5 reads (the one owner of that layout: quantize/ writes it, the
C++ kernel in kernels/matmul_q5.cc reads it).

MatMulQ5 (domain "meshserve"): y = x @ W, W held as 5-bit codes q in blocks of 32 along K,
w = scale * (q - zero_point) per block and output column. A GGUF's Q5_0 tensors are
5.5 bits a weight that way (Q5_1 / Q5_K: their zero points and scales, and quantize's
residual), where MatMulNBits would hold them as 8-bit blocks. `make ops` builds the
library (build/ops/libmeshserve_ops.so) against onnxruntime's C API headers; without it,
graphs are written with MatMulNBits instead (quantize/int4.py asks `available()`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

DOMAIN = "meshserve"
MATMUL_Q5 = "MatMulQ5"
BLOCK = 32  # weights along K per block (one scale and zero point)
GROUP = 16  # output columns per record
RECORD = 4 * 64 + 8 * 8  # bytes per group of 16 columns and block of 32: nibbles, fifth bits
DEFAULT_ZERO_POINT = 16  # Q5_0's, when a node has no zero point input

ENV = "MESHSERVE_OPS"  # a library elsewhere than the build's
_BUILT = Path(__file__).resolve().parent.parent / "build" / "ops" / "libmeshserve_ops.so"


def library() -> Path | None:
    """The custom op library: $MESHSERVE_OPS if set, else the one `make ops` built."""
    path = Path(os.environ[ENV]) if os.environ.get(ENV) else _BUILT
    return path if path.is_file() else None


def available() -> bool:
    return library() is not None


def register(options: Any) -> None:
    """Load the library into onnxruntime SessionOptions (a session reading MatMulQ5 needs
    it). Raises FileNotFoundError naming `make ops` when it is not built."""
    path = library()
    if path is None:
        raise FileNotFoundError(
            f"meshserve's custom op library is not built ({_BUILT}): run `make ops`, or set "
            f"{ENV} to a built libmeshserve_ops.so"
        )
    options.register_custom_ops_library(str(path))


def uses_custom_ops(model: Any) -> bool:
    """Whether an onnx.ModelProto imports meshserve's op domain."""
    return any(o.domain == DOMAIN for o in model.opset_import)


def pack_q5(
    codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulQ5's inputs from blocks: codes uint8 [N, nb, 32] in 0..31, scales [N, nb]
    (float16 or float32: kept as given), zero points uint8 [N, nb] or None (16).

    Returns (records uint8 [G, nb, RECORD], scales [G, nb, 16], zero points [G, nb, 16] or
    None), G = ceil(N / 16), the last group's missing columns zero. In a record, vector j
    (0..7) is 64 bytes: byte 4c + t is the code of column 16g + c at k = 32b + 4j + t;
    vectors 0-3 are the low nibbles of bytes 0-255, vectors 4-7 their high nibbles, and
    bytes 256-319 are eight little-endian uint64, bit 4c + t of the j-th the code's fifth
    bit."""
    n, nb, block = codes.shape
    if block != BLOCK or codes.dtype != np.uint8 or int(codes.max(initial=0)) > 31:
        raise ValueError(f"MatMulQ5 takes 5-bit codes in blocks of {BLOCK}, got {codes.shape}")
    groups = -(-n // GROUP)
    pad = groups * GROUP - n

    def grouped(
        a: np.ndarray,
    ) -> np.ndarray:  # [N, nb, ...] -> [G, 16, nb, ...] -> [G, nb, 16, ...]
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(groups, GROUP, *a.shape[1:])
        return np.ascontiguousarray(np.moveaxis(a, 1, 2))

    # [G, nb, 16 columns, 8 vectors, 4 weights] -> [G, nb, 8 vectors, 16 columns * 4 weights]
    q = grouped(codes).reshape(groups, nb, GROUP, 8, 4).transpose(0, 1, 3, 2, 4)
    q = q.reshape(groups, nb, 8, GROUP * 4)
    nibbles = (q[:, :, :4] & 15) | ((q[:, :, 4:] & 15) << 4)
    fifth = np.packbits(q >> 4, axis=-1, bitorder="little")  # [G, nb, 8, 8]: uint64 each
    records = np.concatenate(
        [nibbles.reshape(groups, nb, 256), fifth.reshape(groups, nb, 64)], axis=-1
    )
    zp = None if zero_points is None else grouped(zero_points.astype(np.uint8))
    return np.ascontiguousarray(records, np.uint8), grouped(scales), zp
