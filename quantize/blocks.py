"""Weight blocks as MatMulNBits stores them, and the grids that fill them: the exact GGUF
grids (Q4_1, Q8_0, Q4_0), found from the weight values themselves, and round to nearest
for weights with none. quantize/gguf_blocks.py fills them from a GGUF's raw bytes instead
(every type it lays out, K-quants included); quantize/int4.py turns them into graph nodes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32


@dataclass
class Blocks:
    """w[k, n] = scales[n, b] * (codes[n, b, j] - zero_points[n, b]) + residual[n, b],
    k = b*block + j."""

    bits: int
    codes: np.ndarray  # uint8 [N, nb, block]
    scales: np.ndarray  # float32 [N, nb]
    zero_points: np.ndarray | None  # uint8 [N, nb]; None = 2**(bits-1)
    residual: np.ndarray | None = None  # float32 [N, nb]; None = 0

    def dequantize(self) -> np.ndarray:
        """The [K, N] weights these blocks stand for (float32 arithmetic)."""
        zp = self.zero_points if self.zero_points is not None else 2 ** (self.bits - 1)
        w = self.scales[..., None] * (
            self.codes.astype(np.float32) - np.asarray(zp, np.float32)[..., None]
        )
        if self.residual is not None:
            w = w + self.residual[..., None]
        n, nb, block = self.codes.shape
        return w.reshape(n, nb * block).T.astype(np.float32)  # type: ignore[no-any-return]

    @property
    def block(self) -> int:
        return int(self.codes.shape[-1])

    def reblocked(self, bits: int, block: int) -> Blocks:
        """The same weights as `bits`-bit codes (>= self.bits: the codes do not change) in
        blocks of `block` (dividing self.block: each block's scale, zero point and residual
        repeated over its parts), so that parts of one fused weight share one layout."""
        if bits < self.bits or self.block % block:
            raise ValueError(f"{self.bits}-bit blocks of {self.block} do not fit {bits}/{block}")
        n, nb, _ = self.codes.shape
        per = self.block // block
        zp = self.zero_points
        if zp is None and bits != self.bits:
            zp = np.full((n, nb), 2 ** (self.bits - 1), np.uint8)

        def split(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.repeat(a, per, axis=1)

        codes = self.codes.reshape(n, nb * per, block)
        return Blocks(
            bits, codes, np.repeat(self.scales, per, axis=1), split(zp), split(self.residual)
        )


def joined(parts: list[Blocks]) -> Blocks:
    """Blocks of several weights over one input, their output columns one after another (a
    fused q/k/v or gate/up): the widest bits and the smallest block of any part."""
    bits, block = max(p.bits for p in parts), min(p.block for p in parts)
    parts = [p.reblocked(bits, block) for p in parts]
    if len(parts) == 1:
        return parts[0]
    default = 2 ** (bits - 1)

    def zero_points(p: Blocks) -> np.ndarray:
        return p.zero_points if p.zero_points is not None else np.full(p.scales.shape, default)

    def residual(p: Blocks) -> np.ndarray:
        return p.residual if p.residual is not None else np.zeros(p.scales.shape, np.float32)

    explicit = any(p.zero_points is not None for p in parts)
    return Blocks(
        bits,
        np.concatenate([p.codes for p in parts]),
        np.concatenate([p.scales for p in parts]),
        np.concatenate([zero_points(p) for p in parts]).astype(np.uint8) if explicit else None,
        np.concatenate([residual(p) for p in parts]).astype(np.float32)
        if any(p.residual is not None for p in parts)
        else None,
    )


def affine(bits: int, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> Blocks:
    """Blocks of w = scale*q + offset (codes [N, nb, block], scale and offset [N, nb]) as
    scale*(q - z) + r: z = round(-offset/scale) clipped to the codes' range, r = offset +
    scale*z (|r| <= scale/2 unless clipped); MatMulNBits takes z, the residual r is added back."""
    safe = np.where(scale == 0, np.float32(1), scale)
    z = np.clip(np.rint(-offset / safe), 0, 2**bits - 1)
    z = np.where(scale == 0, 0, z).astype(np.float32)
    residual = (offset + scale * z).astype(np.float32)
    return Blocks(
        bits, codes.astype(np.uint8), scale.astype(np.float32), z.astype(np.uint8), residual
    )


def _blocks(w: np.ndarray, block: int) -> np.ndarray | None:
    """[K, N] -> [N, K/block, block], or None when K is not a multiple of block."""
    k, n = w.shape
    if k % block:
        return None
    return np.ascontiguousarray(w.T).reshape(n, k // block, block)


def q4_1_blocks(w: np.ndarray, block: int = BLOCK) -> Blocks | None:
    """The Q4_1 decomposition of w [K, N] if every block is d*q + m exactly, else None."""
    x = _blocks(w, block)
    if x is None:
        return None
    lo, hi = x.min(-1), x.max(-1)
    d = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    if not np.array_equal(m, lo):
        return None
    safe = np.where(d == 0, np.float32(1), d)
    q = np.rint((x - m[..., None]) / safe[..., None])
    if q.min() < 0 or q.max() > 15:
        return None
    if not np.array_equal(d[..., None] * q.astype(np.float32) + m[..., None], x):
        return None
    return affine(4, q, d, m)


def q8_0_blocks(w: np.ndarray, block: int = BLOCK) -> Blocks | None:
    """The Q8_0 decomposition of w [K, N] if every block is d*q exactly, else None."""
    x = _blocks(w, block)
    if x is None:
        return None
    amax = np.abs(x).max(-1)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    safe = np.where(d == 0, np.float32(1), d)
    q = np.rint(x / safe[..., None])
    if q.min() < -127 or q.max() > 127:
        return None
    if not np.array_equal(q.astype(np.float32) * d[..., None], x):
        return None
    return Blocks(8, (q + 128).astype(np.uint8), d, None)


def q4_0_blocks(w: np.ndarray, block: int = BLOCK) -> Blocks | None:
    """The Q4_0 decomposition of w [K, N] if every block is d*(q - 8) exactly, else None.
    llama.cpp picks d = -x/8 for the block's x of largest magnitude (d may be negative),
    so that x has code 0; MatMulNBits' default 4-bit zero point is that 8."""
    x = _blocks(w, block)
    if x is None:
        return None
    at = np.abs(x).argmax(-1)
    extreme = np.take_along_axis(x, at[..., None], -1)[..., 0]
    d = (-extreme / np.float32(8)).astype(np.float32)
    if not np.array_equal(d.astype(np.float16).astype(np.float32), d):
        return None
    safe = np.where(d == 0, np.float32(1), d)
    q = np.rint(x / safe[..., None]) + 8
    if q.min() < 0 or q.max() > 15:
        return None
    if not np.array_equal(d[..., None] * (q.astype(np.float32) - 8), x):
        return None
    return Blocks(4, q.astype(np.uint8), d, None)


def rtn_blocks(w: np.ndarray, bits: int, block: int = BLOCK) -> Blocks:
    """Round to nearest: symmetric for 8 bits (as Q8_0), asymmetric (as Q4_1) for 4."""
    k, n = w.shape
    pad = -k % block
    x = _blocks(np.pad(w, ((0, pad), (0, 0))), block)
    assert x is not None
    if bits == 8:
        d = (np.abs(x).max(-1) / np.float32(127)).astype(np.float32)
        safe = np.where(d == 0, np.float32(1), d)
        q = np.clip(np.rint(x / safe[..., None]), -127, 127)
        return Blocks(8, (q + 128).astype(np.uint8), d, None)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    safe = np.where(d == 0, np.float32(1), d)
    z = np.clip(np.rint(-lo / safe), 0, 15)
    q = np.clip(np.rint(x / safe[..., None]) + z[..., None], 0, 15)
    return Blocks(4, q.astype(np.uint8), d, z.astype(np.uint8))


def pack4(values: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 along the last axis -> two per byte, the first in the low nibble."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros_like(values[..., :1])], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)
