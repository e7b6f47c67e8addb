"""meshserve's onnxruntime custom ops: where the library is, how a session loads it, and the
weight layout its MatMulQ reads (the one owner of that layout: quantize/ writes it, the C++
kernels in kernels/matmul_q.cc read it).

MatMulQ (domain "meshserve", attributes K, N, bits, block_size): y = x @ W, W held as 4-,
5-, 6- or 8-bit codes q in blocks of 16 or 32 along K, w = scale * (q - zero_point) + bias
per block and output column, x quantized to int8 per 32 as llama.cpp's Q8_0. A GGUF's Q5_0
tensors are 5.5 bits a weight that way where MatMulNBits holds them as 8-bit blocks (9 bits
a weight), its Q8_0 8.5 (9), its Q6_K 8 (10). `make ops` builds the library
(build/ops/libmeshserve_ops.so) against onnxruntime's C API headers; without it, graphs are
written with MatMulNBits instead (quantize/int4.py asks `available()`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

DOMAIN = "meshserve"
MATMUL_Q = "MatMulQ"
BITS = (4, 5, 6, 8)
BLOCK_SIZES = (16, 32)  # weights along K per block (one scale, zero point and bias)
RECORD_K = 32  # weights along K per record
GROUP = 16  # output columns per record
RECORD = {4: 256, 5: 256 + 64, 6: 256 + 128, 8: 512}  # bytes per record: 16 columns x 32


def default_zero_point(bits: int) -> int:
    """A node's zero point when it has no zero point input (Q5_0's 16, Q8_0's 128)."""
    return 1 << (bits - 1)


ENV = "MESHSERVE_OPS"  # a library elsewhere than the build's
_BUILT = Path(__file__).resolve().parent.parent / "build" / "ops" / "libmeshserve_ops.so"


def library() -> Path | None:
    """The custom op library: $MESHSERVE_OPS if set, else the one `make ops` built."""
    path = Path(os.environ[ENV]) if os.environ.get(ENV) else _BUILT
    return path if path.is_file() else None


def available() -> bool:
    return library() is not None


def register(options: Any) -> None:
    """Load the library into onnxruntime SessionOptions (a session reading MatMulQ needs
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


def pack(
    codes: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    bits: int,
    bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """MatMulQ's inputs from blocks: codes uint8 [N, nb, block] below 2**bits (block 16 or
    32, nb * block a multiple of 32), scales [N, nb] (float16 or float32: kept as given),
    zero points uint8 [N, nb] or None, bias float32 [N, nb] or None.

    Returns (records uint8 [G, K / 32, RECORD[bits]], then scales, zero points and bias as
    [G, nb, 16]), G = ceil(N / 16), the last group's missing columns zero. A record holds
    16 columns x 32 weights along K; its vector j (0..7) is 64 bytes: byte 4c + t holds the
    code of column 16g + c at k = 32b + 4j + t. 8-bit: the 8 vectors as they are. 4-, 5-
    and 6-bit: 256 bytes, vectors 0-3 their low nibbles, vectors 4-7 their high nibbles;
    then, per bit above the fourth, eight little-endian uint64: bit 4c + t of the j-th is
    that bit of vector j's code."""
    n, nb, block = codes.shape
    if bits not in BITS or block not in BLOCK_SIZES or codes.dtype != np.uint8:
        raise ValueError(
            f"MatMulQ takes {BITS}-bit codes in blocks of {BLOCK_SIZES}, got {codes.shape}"
        )
    if (nb * block) % RECORD_K:
        raise ValueError(f"K = {nb * block} is not whole records of {RECORD_K}")
    if int(codes.max(initial=0)) >= 1 << bits:
        raise ValueError(f"codes up to {int(codes.max())} do not fit {bits} bits")
    groups = -(-n // GROUP)
    pad = groups * GROUP - n

    def grouped(a: np.ndarray) -> np.ndarray:  # [N, nb, ...] -> [G, nb, 16, ...]
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(groups, GROUP, *a.shape[1:])
        return np.ascontiguousarray(np.moveaxis(a, 1, 2))

    records_k = nb * block // RECORD_K
    # [G, R, 16 columns, 8 vectors, 4 weights] -> [G, R, 8 vectors, 16 columns * 4 weights]
    q = grouped(codes.reshape(n, records_k, RECORD_K)).reshape(groups, records_k, GROUP, 8, 4)
    q = q.transpose(0, 1, 3, 2, 4).reshape(groups, records_k, 8, GROUP * 4)
    if bits == 8:
        records = q.reshape(groups, records_k, 512)
    else:
        low = (q[:, :, :4] & 15) | ((q[:, :, 4:] & 15) << 4)
        parts: list[np.ndarray] = [low.astype(np.uint8).reshape(groups, records_k, 256)]
        for bit in range(4, bits):  # each bit above the fourth: 8 x 64 bits
            plane = np.packbits((q >> bit) & 1, axis=-1, bitorder="little")
            parts.append(plane.reshape(groups, records_k, 64))
        records = np.concatenate(parts, axis=-1)
    zp = None if zero_points is None else grouped(zero_points.astype(np.uint8))
    b = None if bias is None else grouped(bias.astype(np.float32))
    return np.ascontiguousarray(records, np.uint8), grouped(scales), zp, b
