"""GGUF block layouts: a tensor's raw bytes decoded into MatMulNBits blocks (blocks.Blocks).

Each type's bytes are read as gguf-py's `gguf/quants.py` (and llama.cpp's `ggml-quants.c`)
lay them out, and the file's own codes become MatMulNBits codes without a second rounding:

| GGUF type | per block in the file              | MatMulNBits here                  | exact     |
|-----------|------------------------------------|-----------------------------------|-----------|
| Q8_0      | 32: d*q, q in -127..127            | 8-bit, block 32, codes q+128      | yes       |
| Q4_0      | 32: d*(q-8)                        | 4-bit, block 32, as stored        | yes       |
| Q4_1      | 32: d*q + m                        | 4-bit, block 32, zp + residual    | fp32 rnd. |
| Q5_0      | 32: d*(q-16), 5-bit q              | 8-bit, block 32, codes q+112      | yes       |
| Q5_1      | 32: d*q + m, 5-bit q               | 8-bit, block 32, zp + residual    | fp32 rnd. |
| IQ4_NL    | 32: d*kvalues[q] (a 16-entry table)| 8-bit, block 32, codes kv[q]+128  | yes       |
| Q2_K      | 256 = 16 x 16: d*sc*q - dmin*m     | 4-bit, block 16, zp + residual    | fp32 rnd. |
| Q3_K      | 256 = 16 x 16: d*(sc-32)*(q-4)     | 4-bit, block 16, codes q+4 (zp 8) | yes       |
| Q4_K      | 256 = 8 x 32: d*sc*q - dmin*m      | 4-bit, block 32, zp + residual    | fp32 rnd. |
| Q5_K      | 256 = 8 x 32: d*sc*q - dmin*m      | 8-bit, block 32, zp + residual    | fp32 rnd. |
| Q6_K      | 256 = 16 x 16: d*sc*(q-32)         | 8-bit, block 16, codes q+96       | yes       |

A K-quant's super-block scales (6-bit sc and m, or int8 sc) are folded into one fp32 scale
per sub-block: d*sc is a product of an fp16 and a small integer, so fp32 holds it exactly,
and the sub-block is MatMulNBits' block. An affine block (w = s*q - o) takes the integer
zero point z = round(o/s) and the residual r = s*z - o, added back by quantize/int4.py as
blocksum(x) @ R: "fp32 rnd." means the weights come back to within fp32 rounding of the
file's dequantized values (gguf.quants.dequantize), "yes" bit for bit.
"""

from __future__ import annotations

import numpy as np

from quantize.blocks import Blocks, affine

QK_K = 256
# the 16 signed values an IQ4_NL code indexes (gguf-py's IQ4_NL.kvalues, ggml's kvalues_iq4nl)
IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16
)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n] float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def _bits(b: np.ndarray, shifts: range, mask: int) -> np.ndarray:
    """Bytes [n, groups, width] -> [n, groups, len(shifts), width]: each byte shifted right
    by each shift, masked (how every layout packs its small fields)."""
    s = np.array(shifts, np.uint8).reshape(1, 1, -1, 1)
    return (b[:, :, None, :] >> s) & np.uint8(mask)  # type: ignore[no-any-return]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: the low nibbles, then the high ones (legacy types)."""
    n = qs.shape[0]
    return _bits(qs.reshape(n, 1, 16), range(0, 8, 4), 15).reshape(n, 32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes, a little-endian uint32 -> [n, 32] bits (Q5_0 / Q5_1's fifth bit)."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q8_0(b: np.ndarray) -> Blocks:
    d, q = _f16(b[:, :2]), b[:, 2:].view(np.int8).astype(np.int16)
    return Blocks(8, (q + 128).astype(np.uint8)[:, None], d[:, None], None)


def _q4_0(b: np.ndarray) -> Blocks:
    return Blocks(4, _nibbles(b[:, 2:])[:, None], _f16(b[:, :2])[:, None], None)


def _q4_1(b: np.ndarray) -> Blocks:
    d, m = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    return affine(4, _nibbles(b[:, 4:])[:, None], d, m)


def _q5(b: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's [n, 32] 5-bit codes from qh [n, 4] and qs [n, 16] (the last 20 bytes)."""
    return _nibbles(b[:, -16:]) | (_high_bits(b[:, -20:-16]) << 4)


def _q5_0(b: np.ndarray) -> Blocks:
    return Blocks(8, (_q5(b) + 112)[:, None], _f16(b[:, :2])[:, None], None)


def _q5_1(b: np.ndarray) -> Blocks:
    d, m = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    return affine(8, _q5(b)[:, None], d, m)


def _iq4_nl(b: np.ndarray) -> Blocks:
    codes = (IQ4_NL_VALUES[_nibbles(b[:, 2:])] + 128).astype(np.uint8)
    return Blocks(8, codes[:, None], _f16(b[:, :2])[:, None], None)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q2_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    codes = _bits(qs.reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 16, 16)
    scale = d[:, None] * (scales & 0xF).astype(np.float32)
    offset = -(dmin[:, None] * (scales >> 4).astype(np.float32))
    return affine(4, codes, scale, offset)


def _q3_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    hmask, qs, s, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = _bits(s[:, :8].reshape(n, 1, 8), range(0, 8, 4), 15).reshape(n, 16)
    high = _bits(s[:, 8:].reshape(n, 1, 4), range(0, 8, 2), 3).reshape(n, 16)
    sc = (low | (high << 4)).astype(np.float32) - 32
    ql = _bits(qs.reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 16, 16).astype(np.int16)
    qh = _bits(hmask.reshape(n, 1, 32), range(8), 1).reshape(n, 16, 16).astype(np.int16)
    q = ql - 4 * (1 - qh)  # the high bit set means no offset
    return Blocks(4, (q + 8).astype(np.uint8), d[:, None] * sc, None)


def _q4_k_codes(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 sub-blocks of 32 four-bit codes: each 32 bytes' low nibbles, then high."""
    return _bits(qs.reshape(-1, 4, 32), range(0, 8, 4), 15).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> Blocks:
    d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _scale_min_k4(b[:, 4:16])
    return affine(4, _q4_k_codes(b[:, 16:]), d * sc, -(dmin * mn))


def _q5_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh = _bits(b[:, 16:48].reshape(n, 1, 32), range(8), 1).reshape(n, 8, 32)
    codes = _q4_k_codes(b[:, 48:]) | (qh << 4)
    return affine(8, codes, d * sc, -(dmin * mn))


def _q6_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = _bits(ql.reshape(n, 2, 64), range(0, 8, 4), 15).reshape(n, 8, 32)
    high = _bits(qh.reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 8, 32)
    q = (low | (high << 4)).reshape(n, 16, 16)
    scale = d[:, None] * scales.view(np.int8).astype(np.float32)
    return Blocks(8, (q + 96).astype(np.uint8), scale, None)


# type name -> (weights per block in the file, bytes per block, decoder of [n, bytes] blocks)
LAYOUTS = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "IQ4_NL": (32, 18, _iq4_nl),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


def decode(kind: str, raw: np.ndarray, cols: int) -> Blocks:
    """A tensor's raw bytes [rows, bytes per row] (gguf_index.GGUFTensor.raw) as Blocks of
    codes [rows, cols / block, block]: the file's own codes, sub-block by sub-block."""
    if kind not in LAYOUTS:
        raise ValueError(f"GGUF type {kind} has no MatMulNBits layout (have: {', '.join(LAYOUTS)})")
    per, size, decoder = LAYOUTS[kind]
    rows = raw.shape[0]
    if cols % per or raw.shape[1] != cols // per * size:
        raise ValueError(
            f"{kind}: {raw.shape[1]} bytes per row of {cols} weights, expected {cols // per * size}"
        )
    b = decoder(np.ascontiguousarray(raw).reshape(rows * (cols // per), size))
    block = b.codes.shape[-1]
    nb = cols // block

    def rows_of(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a.reshape(rows, nb, *a.shape[2:])

    codes = b.codes.reshape(rows, nb, block)
    scales = b.scales.astype(np.float32).reshape(rows, nb)
    return Blocks(b.bits, codes, scales, rows_of(b.zero_points), rows_of(b.residual))
