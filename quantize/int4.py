"""Weight-only MatMulNBits that keeps what a GGUF file already quantized, exactly.

A GGUF Q4_1 block is 32 weights along the input dimension stored as w = d*q + m (q in
0..15; d and m fp16). MatMulNBits dequantizes as scale*(q - zp) with an integer zp in
0..15, so a Q4_1 block fits it only when -m/d is an integer, which is true of 0.3% of
SmolLM2's blocks. Rounding the zero point moves every weight of a block by the same
amount (up to d/2), and quantizing the dequantized weights again (what onnxruntime's
quantizer does) adds a second rounding on top of the first; both are lossy where none is
needed. Here every block is written as

    w = d*(q - z) + r,   z = clip(round(-m/d), 0, 15),   r = m + d*z   (|r| <= d/2)

MatMulNBits computes x @ d*(q - z) from the very codes the GGUF holds, and the residuals
r (one float per block and output column) are added back as blocksum(x) @ R, where
blocksum sums x over each block of 32 inputs: a [..., K/32] x [K/32, N] MatMul, 1/32 of
the MatMul's rows. Weight values are then reproduced to fp32 rounding. A Q8_0 block
(w = d*q, q in -127..127) is MatMulNBits 8-bit with codes q + 128 and no residual: exact
too, so Q8_0 tensors (token_embd / a tied lm_head) stay 8-bit rather than being pushed
down to 4.

The grids are found from the weight values themselves (a block is Q4_1 if d*q + m with
d = fp16((max - min)/15), m = min reproduces all 32 values bit for bit), so this works on
any ONNX graph whose MatMul weights are [in, out] initializers (or a Transpose of a
[out, in] one): the exported torch graph, a graph built with onnx.helper, a tensor-parallel
slice. With `gguf_path`, weights whose initializer is named after a GGUF tensor (GGUF
name or our torch name) must come out as that tensor's type, or QuantizeError says which.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

BLOCK = 32
MS_DOMAIN = "com.microsoft"

Q4_1 = "q4_1-exact"  # 4-bit codes straight from the GGUF grid, residual added back
Q8_0 = "q8_0-exact"  # 8-bit codes straight from the GGUF grid
Q4_0 = "q4_0-exact"  # 4-bit codes straight from the GGUF grid, zero point 8
INT8 = "int8-rtn"  # no exact grid: symmetric 8-bit blocks, round to nearest
INT4 = "int4-rtn"  # no exact grid: asymmetric 4-bit blocks, round to nearest
KEPT = "fp32-kept"  # left as a float MatMul

OTHERWISE = {"int8": INT8, "int4": INT4, "keep": KEPT}


class QuantizeError(Exception):
    """A weight named after a GGUF tensor did not come out as that tensor's type."""


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
    z = np.clip(np.rint(-m / safe), 0, 15)
    z = np.where(d == 0, 0, z).astype(np.float32)
    residual = (m + d * z).astype(np.float32)
    return Blocks(4, q.astype(np.uint8), d, z.astype(np.uint8), residual)


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


def _pack4(values: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 along the last axis -> two per byte, the first in the low nibble."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros_like(values[..., :1])], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


# ---- naming: which GGUF tensor an initializer stands for ---------------------------------

_TORCH_TO_GGUF = {
    "q": ("attn_q",),
    "k": ("attn_k",),
    "v": ("attn_v",),
    "qkv": ("attn_q", "attn_k", "attn_v"),  # the step graph's packed projection
    "o": ("attn_output",),
    "gate": ("ffn_gate",),
    "up": ("ffn_up",),
    "gate_up": ("ffn_gate", "ffn_up"),  # the step graph's fused MLP input
    "down": ("ffn_down",),
}
_TORCH_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(q|k|v|qkv|o|gate|up|gate_up|down)\.weight$")


def gguf_names(initializer: str) -> tuple[str, ...]:
    """The GGUF tensors an initializer is named after (GGUF or our torch names; a fused
    weight stands for several, its rows in their order); () if none."""
    name = initializer.removesuffix("_transposed").removesuffix(".T")
    if re.fullmatch(r"blk\.\d+\.\w+\.weight|token_embd\.weight|output\.weight", name):
        return (name,)
    if name in ("embed.weight", "lm_head.weight"):
        return ("token_embd.weight" if name == "embed.weight" else "output.weight",)
    found = _TORCH_LAYER.search(name)
    if found:
        return tuple(f"blk.{found.group(1)}.{t}.weight" for t in _TORCH_TO_GGUF[found.group(2)])
    return ()


def gguf_name(initializer: str) -> str | None:
    """The GGUF tensor an initializer is named after, if any (the first of a fused one)."""
    names = gguf_names(initializer)
    return names[0] if names else None


@dataclass(frozen=True)
class GGUFTensor:
    kind: str  # Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # numpy order: [out, in] for a weight
    start: int  # byte offset in the file
    nbytes: int

    def raw(self, path: Path) -> np.ndarray:
        """The tensor's bytes, [rows, bytes per row], as gguf.quants.dequantize takes them."""
        data = np.fromfile(path, np.uint8, count=self.nbytes, offset=self.start)
        return data.reshape(self.shape[0], -1) if len(self.shape) > 1 else data


_SCALAR = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def gguf_index(gguf_path: Path) -> dict[str, GGUFTensor]:
    """Name -> type, shape and place of every tensor in a GGUF (v2/v3) file, read from its
    header alone (gguf.GGUFReader also parses every vocabulary string: ~30 s here)."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(gguf_path, "rb") as f:
        buf = f.read(64 << 20)  # header + metadata (the tensor data is not read)
    pos = 0

    def take(fmt: str) -> int | float:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value  # type: ignore[no-any-return]

    def string() -> str:
        nonlocal pos
        n = int(take("Q"))
        pos += n
        return buf[pos - n : pos].decode()

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            string()
        elif kind == 9:
            item, count = int(take("I")), int(take("Q"))
            if item in _SCALAR:
                pos += struct.calcsize(_SCALAR[item]) * count
            else:
                for _ in range(count):
                    skip(item)
        else:
            take(_SCALAR[kind])

    if buf[:4] != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file")
    pos = 8
    tensors, kvs = int(take("Q")), int(take("Q"))
    alignment = 32
    for _ in range(kvs):
        key, kind = string(), int(take("I"))
        if key == "general.alignment":
            alignment = int(take(_SCALAR[kind]))
        else:
            skip(kind)
    infos = []
    for _ in range(tensors):
        name = string()
        dims = [int(take("Q")) for _ in range(int(take("I")))]
        kind, offset = GGMLQuantizationType(int(take("I"))), int(take("Q"))
        infos.append((name, dims, kind, offset))
    data = -(-pos // alignment) * alignment
    out = {}
    for name, dims, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(dims))
        shape = tuple(reversed(dims))
        out[name] = GGUFTensor(kind.name, shape, data + offset, count // block * size)
    return out


def gguf_types(gguf_path: Path) -> dict[str, str]:
    """GGUF tensor name -> its type name (Q4_1, Q8_0, F32, ...)."""
    return {name: t.kind for name, t in gguf_index(gguf_path).items()}


_EXPECTED = {"Q4_1": Q4_1, "Q8_0": Q8_0, "Q4_0": Q4_0}


# ---- the graph rewrite ------------------------------------------------------------------


@dataclass
class Entry:
    weight: str
    shape: tuple[int, int]
    codec: str
    max_abs_error: float
    bytes_before: int
    bytes_after: int


@dataclass
class Report:
    entries: list[Entry] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.codec] = out.get(e.codec, 0) + 1
        return out

    @property
    def max_abs_error(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.entries:
            out[e.codec] = max(out.get(e.codec, 0.0), e.max_abs_error)
        return out


def _decompose(
    w: np.ndarray, block: int, otherwise: str, expected: str | None
) -> tuple[str, Blocks | None]:
    for codec, find in ((Q4_1, q4_1_blocks), (Q8_0, q8_0_blocks), (Q4_0, q4_0_blocks)):
        if expected in (None, codec):
            found = find(w, block)
            if found is not None:
                return codec, found
    if expected in (Q4_1, Q8_0, Q4_0):
        return expected, None  # the caller reports the mismatch
    if otherwise == KEPT:
        return KEPT, None
    return otherwise, rtn_blocks(w, 8 if otherwise == INT8 else 4, block)


class _Graph:
    """Index of one onnx graph: initializers by name, producers and consumers of values."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {i.name: i for i in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.uses: dict[str, int] = {}
        for n in graph.node:
            for i in n.input:
                self.uses[i] = self.uses.get(i, 0) + 1
        for o in graph.output:
            self.uses[o.name] = self.uses.get(o.name, 0) + 1

    def weight(self, name: str) -> tuple[str, np.ndarray, onnx.NodeProto | None] | None:
        """(source initializer name, [K, N] float array, Transpose node or None)."""
        if name in self.inits:
            array = numpy_helper.to_array(self.inits[name])
            return (name, array, None) if array.ndim == 2 and array.dtype.kind == "f" else None
        node = self.producer.get(name)
        if node is None or node.op_type != "Transpose" or node.input[0] not in self.inits:
            return None
        perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
        array = numpy_helper.to_array(self.inits[node.input[0]])
        if array.ndim != 2 or array.dtype.kind != "f" or perm not in ([], [[1, 0]]):
            return None
        return node.input[0], np.ascontiguousarray(array.T), node


def quantize_matmuls(
    model: onnx.ModelProto,
    *,
    gguf_path: Path | None = None,
    block_size: int = BLOCK,
    accuracy_level: int = 4,
    otherwise: str = "int8",
    exact: bool = True,
    only: Iterable[str] | None = None,
) -> Report:
    """Rewrite, in place, every MatMul of `model`'s main graph whose B is a float [K, N]
    initializer (or Transpose of one) as MatMulNBits; returns what each weight became.

    otherwise: what a weight with no exact GGUF grid becomes ("int8", "int4" or "keep");
    a weight named after a GGUF tensor of another type (F16, Q6_K, ...) gets int8 at least.
    exact: add the Q4_1 residuals back (False: round them away, for comparison only).
    only: restrict to these MatMul output names (default: all).
    accuracy_level: MatMulNBits' compute type (4 = int8 activations per block, the fast
    CPU path; 0/1 = float).
    """
    if otherwise not in OTHERWISE:
        raise ValueError(f"otherwise must be one of {sorted(OTHERWISE)}, not {otherwise!r}")
    types = gguf_types(gguf_path) if gguf_path is not None else {}
    g = _Graph(model.graph)
    wanted = set(only) if only is not None else None
    report = Report()
    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    blocksums: dict[tuple[str, int], str] = {}
    dropped: set[str] = set()
    replaced: set[str] = set()
    for node in model.graph.node:
        found = g.weight(node.input[1]) if node.op_type == "MatMul" else None
        if found is None or (wanted is not None and node.output[0] not in wanted):
            new_nodes.append(node)
            continue
        source, w, transpose = found
        gnames = gguf_names(source)
        if gnames == ("output.weight",) and "output.weight" not in types:
            gnames = ("token_embd.weight",)  # tied embeddings: the lm_head is token_embd
        kinds = {types.get(n, "") for n in gnames}
        gname = gnames[0] if gnames else None
        # a fused weight is exact only when every part is of one type (else: as any F16)
        expected = _EXPECTED.get(kinds.pop()) if len(kinds) == 1 else None
        policy = OTHERWISE[otherwise]
        if gname in types and expected is None and policy == INT4:
            policy = INT8  # F16/F32/K-quant tensors in the GGUF: not pushed below 8 bits
        codec, blocks = _decompose(w, block_size, policy, expected)
        if expected is not None and blocks is None:
            raise QuantizeError(
                f"{source} is {types[gname or '']} {gname} in {gguf_path}, but its values "
                f"are not that grid in blocks of {block_size} along the input dimension"
            )
        if blocks is None:
            new_nodes.append(node)
            report.entries.append(Entry(source, w.shape, KEPT, 0.0, w.nbytes, w.nbytes))
            continue
        if not exact:
            blocks.residual = None
        prefix = _unique(source, g.inits)
        nodes, inits = _matmulnbits(node, prefix, blocks, w.shape, block_size, accuracy_level)
        if blocks.residual is not None and np.any(blocks.residual):
            key = (node.input[0], blocks.codes.shape[1])
            if key not in blocksums:
                extra, blocksums[key] = _blocksum(key[0], prefix, key[1], block_size)
                nodes = extra + nodes
            nodes, more = _add_residual(nodes, node.output[0], blocksums[key], prefix, blocks)
            inits += more
        new_nodes += nodes
        new_inits += inits
        after = sum(i.ByteSize() for i in inits)
        err = float(np.abs(blocks.dequantize()[: w.shape[0]] - w).max())
        report.entries.append(Entry(source, w.shape, codec, err, w.nbytes, after))
        replaced.add(source)
        g.uses[node.input[1]] -= 1
        if transpose is not None and g.uses[node.input[1]] == 0:
            dropped.add(transpose.output[0])
            g.uses[source] -= 1
    unused = {name for name in replaced if g.uses[name] == 0}
    _replace(model.graph, new_nodes, new_inits, dropped, unused)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return report


def _unique(base: str, taken: dict) -> str:
    name = re.sub(r"[^\w.]", "_", base)
    while f"{name}_Q" in taken:
        name += "_"
    taken[f"{name}_Q"] = None
    return name


def _matmulnbits(
    node: onnx.NodeProto,
    prefix: str,
    blocks: Blocks,
    shape: tuple[int, int],
    block: int,
    accuracy_level: int,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    k, n = shape
    codes = _pack4(blocks.codes) if blocks.bits == 4 else blocks.codes
    inits = [
        numpy_helper.from_array(codes, f"{prefix}_Q{blocks.bits}"),
        numpy_helper.from_array(blocks.scales.astype(np.float32), f"{prefix}_scales"),
    ]
    if blocks.zero_points is not None:
        zp = blocks.zero_points
        zp = _pack4(zp) if blocks.bits == 4 else zp
        inits.append(numpy_helper.from_array(zp.reshape(-1), f"{prefix}_zero_points"))
    out = helper.make_node(
        "MatMulNBits",
        [node.input[0], *(i.name for i in inits)],
        [node.output[0]],
        name=f"{node.name or prefix}_Q{blocks.bits}",
        domain=MS_DOMAIN,
    )
    attrs = {"K": k, "N": n, "bits": blocks.bits, "block_size": block}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    out.attribute.extend(helper.make_attribute(key, value) for key, value in attrs.items())
    return [out], inits


def _blocksum(x: str, prefix: str, nb: int, block: int) -> tuple[list[onnx.NodeProto], str]:
    """Nodes computing the sums of x [..., K] over blocks of `block`: [..., K/block]."""
    p = f"{prefix}_blocksum"
    nodes = [
        helper.make_node("Shape", [x], [f"{p}_shape"], end=-1),
        helper.make_node(
            "Constant",
            [],
            [f"{p}_tail"],
            value=numpy_helper.from_array(np.array([nb, block], np.int64)),
        ),
        helper.make_node("Concat", [f"{p}_shape", f"{p}_tail"], [f"{p}_to"], axis=0),
        helper.make_node("Reshape", [x, f"{p}_to"], [f"{p}_blocks"]),
        helper.make_node(
            "Constant", [], [f"{p}_axis"], value=numpy_helper.from_array(np.array([-1], np.int64))
        ),
        helper.make_node("ReduceSum", [f"{p}_blocks", f"{p}_axis"], [p], keepdims=0),
    ]
    return nodes, p


def _add_residual(
    nodes: list[onnx.NodeProto], output: str, sums: str, prefix: str, blocks: Blocks
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Route MatMulNBits to a temporary output and add blocksum(x) @ R to it."""
    assert blocks.residual is not None
    main = nodes[-1]
    main.output[0] = f"{prefix}_main"
    r = numpy_helper.from_array(np.ascontiguousarray(blocks.residual.T), f"{prefix}_residual")
    extra = [
        helper.make_node("MatMul", [sums, r.name], [f"{prefix}_correction"]),
        helper.make_node("Add", [main.output[0], f"{prefix}_correction"], [output]),
    ]
    return nodes + extra, [r]


def _replace(
    graph: onnx.GraphProto,
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    dropped: set[str],
    unused: set[str],
) -> None:
    """Swap in the new nodes; drop replaced Transposes and weights nothing reads now."""
    kept_nodes = [n for n in nodes if not (set(n.output) & dropped)]
    kept_inits = [i for i in graph.initializer if i.name not in unused]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept_inits + inits)
