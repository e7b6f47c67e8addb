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
blocksum sums x over each block of 32 inputs (a Reshape and a ReduceSum, once per input)
and blocksum(x) [M, K/32] @ R [K/32, N] is 1/32 of the MatMul's rows. Weight values are then
reproduced to fp32 rounding. A Q8_0 block
(w = d*q, q in -127..127) is MatMulNBits 8-bit with codes q + 128 and no residual: exact
too, so Q8_0 tensors (token_embd / a tied lm_head) stay 8-bit rather than being pushed
down to 4.

The grids are found from the weight values themselves (a block is Q4_1 if d*q + m with
d = fp16((max - min)/15), m = min reproduces all 32 values bit for bit), so this works on
any ONNX graph whose MatMul weights are [in, out] initializers (or a Transpose of a
[out, in] one): the exported torch graph, a graph built with onnx.helper, a tensor-parallel
slice. With `gguf_path`, weights whose initializer is named after a GGUF tensor (GGUF
name or our torch name) must come out as that tensor's type, or QuantizeError says which.

Every other GGUF block type (the K-quants Q2_K..Q6_K, Q5_0, Q5_1, IQ4_NL), and a fused
weight whose parts differ in type (q/k/v of a Q4_K_M file: Q4_K, Q4_K, Q6_K), is read from
the file's raw bytes instead (quantize/gguf_blocks.py: each type's MatMulNBits layout and
its exactness): the decoded codes must reproduce the graph's weight values (columns matched
by value, so RoPE-permuted or fused rows are found wherever they are), else QuantizeError.
Parts of different layouts share one MatMulNBits by re-blocking to the widest bits and the
smallest block (blocks.joined).

Where meshserve's own op is built (common/custom_ops.py, `make ops`), a GGUF's blocks go to
MatMulQ instead of MatMulNBits (_op_blocks): the same codes at their own width (Q5_0 at 5
bits, Q6_K at 6, where MatMulNBits takes 8), and an affine block's residual as the op's
bias rather than a block-sum MatMul.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from common import custom_ops
from quantize import gguf_blocks
from quantize.blocks import (
    BLOCK,
    Blocks,
    joined,
    pack4,
    q4_0_blocks,
    q4_1_blocks,
    q8_0_blocks,
    rtn_blocks,
)
from quantize.gguf_index import GGUFTensor, gguf_index, gguf_names, gguf_types

MS_DOMAIN = "com.microsoft"

Q4_1 = "q4_1-exact"  # 4-bit codes straight from the GGUF grid, residual added back
Q8_0 = "q8_0-exact"  # 8-bit codes straight from the GGUF grid
Q4_0 = "q4_0-exact"  # 4-bit codes straight from the GGUF grid, zero point 8
INT8 = "int8-rtn"  # no exact grid: symmetric 8-bit blocks, round to nearest
INT4 = "int4-rtn"  # no exact grid: asymmetric 4-bit blocks, round to nearest
KEPT = "fp32-kept"  # left as a float MatMul
FILE_EXACT = "-exact"  # after the GGUF types read from the file's bytes: "q4_k+q6_k-exact"
OP = "+matmulq"  # after a codec served by meshserve's MatMulQ (common/custom_ops.py)

OTHERWISE = {"int8": INT8, "int4": INT4, "keep": KEPT}


class QuantizeError(Exception):
    """A weight named after a GGUF tensor did not come out as that tensor's type."""


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


def _parts(source: str, types: dict[str, str]) -> tuple[str, ...]:
    """The GGUF tensors weight `source` is made of, in the order of its output columns."""
    gnames = gguf_names(source)
    if gnames == ("output.weight",) and "output.weight" not in types:
        gnames = ("token_embd.weight",)  # tied embeddings: the lm_head is token_embd
    return gnames


def _from_file(source: str, gnames: tuple[str, ...], types: dict[str, str]) -> bool:
    """Whether weight `source` is read from the file's bytes: every part has a layout in
    gguf_blocks, and they are not all one type the value-based grids find."""
    kinds = [types.get(n, "") for n in gnames]
    if not kinds or not all(k in gguf_blocks.LAYOUTS for k in kinds):
        return False
    return not (len(set(kinds)) == 1 and kinds[0] in _EXPECTED)


def _file_blocks(
    source: str, w: np.ndarray, gnames: tuple[str, ...], index: dict[str, GGUFTensor], path: Path
) -> tuple[str, Blocks]:
    """(codec, blocks) of weight `source` ([K, N]) from the raw bytes of its GGUF parts."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    parts, values = [], []
    for name in gnames:
        t = index[name]
        raw = t.raw(path)
        parts.append(gguf_blocks.decode(t.kind, raw, t.shape[1]))
        values.append(
            np.asarray(dequantize(raw, GGMLQuantizationType[t.kind]), np.float32).reshape(t.shape)
        )
    blocks = joined(parts)
    kinds = [index[n].kind for n in gnames]
    what = f"{source} ({' + '.join(f'{k} {n}' for k, n in zip(kinds, gnames, strict=True))})"
    order = _columns(w, np.concatenate(values))
    if order is None:
        raise QuantizeError(f"{what}: its values are not the dequantized rows of {path}")
    if not np.array_equal(order, np.arange(len(order))):
        blocks = Blocks(
            blocks.bits,
            blocks.codes[order],
            blocks.scales[order],
            None if blocks.zero_points is None else blocks.zero_points[order],
            None if blocks.residual is None else blocks.residual[order],
        )
    err = float(np.abs(blocks.dequantize() - w).max())
    if err > 2.0**-20 * float(np.abs(w).max()):  # a few fp32 ulps of the largest weight
        raise QuantizeError(f"{what}: the file's codes reproduce its values only to {err:.3g}")
    return "+".join(dict.fromkeys(k.lower() for k in kinds)) + FILE_EXACT, blocks


def _columns(w: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """order such that rows[order] == w.T bit for bit (each column of w [K, N] found among
    the file's rows [N, K]), or None."""
    wt = np.ascontiguousarray(w.T)
    if wt.shape != rows.shape:
        return None
    if np.array_equal(wt, rows):
        return np.arange(len(rows))
    where = {row.tobytes(): i for i, row in enumerate(rows)}
    found = [where.get(col.tobytes()) for col in wt]
    if any(i is None for i in found):
        return None
    return np.array(found, np.int64)


def _wanted(
    source: str, types: dict[str, str], otherwise: str
) -> tuple[str | None, str | None, str]:
    """For weight `source`: the GGUF tensor it is named after, the exact codec that
    tensor's type demands (None: no exact grid required), and what it becomes otherwise."""
    gnames = _parts(source, types)
    kinds = {types.get(n, "") for n in gnames}
    gname = gnames[0] if gnames else None
    # a fused weight is exact only when every part is of one type (else: as any F16)
    expected = _EXPECTED.get(kinds.pop()) if len(kinds) == 1 else None
    policy = OTHERWISE[otherwise]
    if gname in types and expected is None and policy == INT4:
        policy = INT8  # F16/F32/K-quant tensors in the GGUF: not pushed below 8 bits
    return gname, expected, policy


def quantize_matmuls(
    model: onnx.ModelProto,
    *,
    gguf_path: Path | None = None,
    block_size: int = BLOCK,
    accuracy_level: int = 4,
    otherwise: str = "int8",
    exact: bool = True,
    only: Iterable[str] | None = None,
    custom_op: bool | None = None,
) -> Report:
    """Rewrite, in place, every MatMul of `model`'s main graph whose B is a float [K, N]
    initializer (or Transpose of one) as MatMulNBits; returns what each weight became.

    otherwise: what a weight with no exact GGUF grid becomes ("int8", "int4" or "keep");
    a weight named after a GGUF tensor of another type (F16, Q6_K, ...) gets int8 at least.
    exact: add the Q4_1 residuals back (False: round them away, for comparison only).
    only: restrict to these MatMul output names (default: all).
    accuracy_level: MatMulNBits' compute type (4 = int8 activations per block, the fast
    CPU path; 0/1 = float).
    custom_op: serve a GGUF's blocks of 32 with meshserve's MatMulQ (_op_blocks: its 5-bit
    types at 5 bits a weight, not MatMulNBits' 8) rather than MatMulNBits. Default: with
    gguf_path, accuracy_level 4 (the CPU's int8 path) and the library built.
    """
    if custom_op is None:
        custom_op = gguf_path is not None and accuracy_level == 4 and custom_ops.available()
    if otherwise not in OTHERWISE:
        raise ValueError(f"otherwise must be one of {sorted(OTHERWISE)}, not {otherwise!r}")
    types = gguf_types(gguf_path) if gguf_path is not None else {}
    index: dict[str, GGUFTensor] = {}  # read when a weight needs the file's bytes
    g = _Graph(model.graph)
    wanted = set(only) if only is not None else None
    report = Report()
    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    blocksums: dict[tuple[str, int], str] = {}
    shared: set[str] = set()  # the block sums' constants added, by name
    dropped: set[str] = set()
    replaced: set[str] = set()
    for node in model.graph.node:
        found = g.weight(node.input[1]) if node.op_type == "MatMul" else None
        if found is None or (wanted is not None and node.output[0] not in wanted):
            new_nodes.append(node)
            continue
        source, w, transpose = found
        gname, expected, policy = _wanted(source, types, otherwise)
        gnames = _parts(source, types)
        blocks: Blocks | None
        if gguf_path is not None and _from_file(source, gnames, types):
            index = index or gguf_index(gguf_path)
            codec, blocks = _file_blocks(source, w, gnames, index, gguf_path)
        else:
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
        op = _op_blocks(blocks, w.shape[0]) if custom_op else None
        if op is not None:
            nodes, inits = _matmul_q(node, prefix, op, w.shape)
            codec += OP
        else:
            nodes, inits = _matmulnbits(node, prefix, blocks, w.shape, blocks.block, accuracy_level)
        if op is None and blocks.residual is not None and np.any(blocks.residual):
            key = (node.input[0], blocks.codes.shape[1])
            if key not in blocksums:
                blocksums[key] = f"{prefix}_blocksum"
                sums, consts = _blocksum(key[0], blocksums[key], w.shape[0], blocks.block)
                new_inits += [c for c in consts if c.name not in shared]
                shared.update(c.name for c in consts)
                nodes = [*sums, *nodes]
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
    ours = any(e.codec.endswith(OP) for e in report.entries)
    for domain in [MS_DOMAIN, *([custom_ops.DOMAIN] if ours else [])]:
        if not any(o.domain == domain for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(domain, 1))
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
    codes = pack4(blocks.codes) if blocks.bits == 4 else blocks.codes
    inits = [
        numpy_helper.from_array(codes, f"{prefix}_Q{blocks.bits}"),
        numpy_helper.from_array(blocks.scales.astype(np.float32), f"{prefix}_scales"),
    ]
    if blocks.zero_points is not None:
        zp = blocks.zero_points
        zp = pack4(zp) if blocks.bits == 4 else zp
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


@dataclass
class OpBlocks:
    """Blocks as MatMulQ takes them (common/custom_ops.py)."""

    bits: int
    codes: np.ndarray  # uint8 [N, nb, block], below 2**bits
    scales: np.ndarray  # fp16 where that holds them exactly (every legacy type's d), else fp32
    zero_points: np.ndarray | None  # None: the op's default, 2**(bits-1)
    bias: np.ndarray | None  # an affine block's residual, added by the op


def _op_blocks(blocks: Blocks, k: int) -> OpBlocks | None:
    """`blocks` of a [k, N] weight as MatMulQ takes them, or None (they stay MatMulNBits).
    8-bit blocks take the fewest bits that their codes span: 5 for Q5_0 (codes q + 112,
    zero point 128: q, 16) and the affine Q5_1 / Q5_K, 6 for Q6_K (codes q + 96: q, 32), 8
    for Q8_0 and IQ4_NL; 4-bit blocks stay 4. The residual of an affine block becomes the
    op's bias."""
    nb, block = blocks.codes.shape[1], blocks.block
    if block not in custom_ops.BLOCK_SIZES or nb * block != k or k % custom_ops.RECORD_K:
        return None
    default = np.full(blocks.scales.shape, 1 << (blocks.bits - 1))
    zp = (blocks.zero_points if blocks.zero_points is not None else default).astype(np.int32)
    low, high = int(blocks.codes.min()), int(blocks.codes.max())
    bits = 4 if blocks.bits == 4 else next(b for b in (5, 6, 8) if high - low < 1 << b)
    # codes - base must fit the bits and zero points - base a byte: first choice, the base
    # that leaves the op's default zero point (no zero point input), then 0, then low
    one = int(zp.flat[0])
    bases = [one - custom_ops.default_zero_point(bits)] if np.all(zp == one) else []
    fits = [
        b
        for b in [*bases, 0, low]
        if b <= low and high - b < 1 << bits and zp.min() >= b and zp.max() - b <= 255
    ]
    if not fits:
        return None
    base = fits[0]
    zp = zp - base
    half = blocks.scales.astype(np.float16)
    exact = np.array_equal(half.astype(np.float32), blocks.scales)
    uniform = bool(np.all(zp == custom_ops.default_zero_point(bits)))
    return OpBlocks(
        bits,
        blocks.codes - np.uint8(base),
        half if exact else blocks.scales.astype(np.float32),
        None if uniform else zp.astype(np.uint8),
        blocks.residual,
    )


def _matmul_q(
    node: onnx.NodeProto, prefix: str, op: OpBlocks, shape: tuple[int, int]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    k, n = shape
    records, scales, zero_points, bias = custom_ops.pack(
        op.codes, op.scales, op.zero_points, op.bits, op.bias
    )
    inits = [
        numpy_helper.from_array(records, f"{prefix}_Q{op.bits}"),
        numpy_helper.from_array(scales, f"{prefix}_scales"),
    ]
    names = [i.name for i in inits]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, f"{prefix}_zero_points"))
    names.append(inits[-1].name if zero_points is not None else "")
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, f"{prefix}_bias"))
        names.append(inits[-1].name)
    out = helper.make_node(
        custom_ops.MATMUL_Q,
        [node.input[0], *names],
        [node.output[0]],
        name=f"{node.name or prefix}_Q{op.bits}",
        domain=custom_ops.DOMAIN,
        K=k,
        N=n,
        bits=op.bits,
        block_size=op.codes.shape[-1],
    )
    while out.input[-1] == "":  # trailing optional inputs left out
        out.input.pop()
    return [out], inits


def _blocksum(
    x: str, out: str, k: int, block: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes that sum x [..., K] over its blocks into `out` [M, K/block] (M the product of
    x's leading dimensions, whatever x's rank; _add_residual gives the correction main's
    shape back), and the constants they read, shared by every residual over inputs of
    width K: a Reshape to [-1, K/block, block] and a ReduceSum. (x @ a 0/1 [K, K/block]
    matrix keeps x's rank in one node, but computes K/block columns: 66 against 17 us at
    one row, 2.5 against 0.18 ms at 256 rows, K = 4864 on onnxruntime 1.23, 2 cores.) Only
    weights whose K is whole blocks have residuals: a grid is found in whole blocks, and a
    GGUF tensor's rows are whole blocks."""
    assert k % block == 0, f"a residual over K = {k}, not whole blocks of {block}"
    shape = numpy_helper.from_array(
        np.array([-1, k // block, block], np.int64), f"blocksum_shape_{k // block}x{block}"
    )
    axes = numpy_helper.from_array(np.array([-1], np.int64), "blocksum_axes")
    nodes = [
        helper.make_node("Reshape", [x, shape.name], [f"{out}_blocks"]),
        helper.make_node("ReduceSum", [f"{out}_blocks", axes.name], [out], keepdims=0),
    ]
    return nodes, [shape, axes]


def _add_residual(
    nodes: list[onnx.NodeProto], output: str, sums: str, prefix: str, blocks: Blocks
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Route MatMulNBits to a temporary output and add blocksum(x) @ R to it, given the
    shape of that output (the sums are [M, K/block], see _blocksum)."""
    assert blocks.residual is not None
    main = nodes[-1]
    main.output[0] = f"{prefix}_main"
    r = numpy_helper.from_array(np.ascontiguousarray(blocks.residual.T), f"{prefix}_residual")
    flat, correction = f"{prefix}_correction_flat", f"{prefix}_correction"
    extra = [
        helper.make_node("MatMul", [sums, r.name], [flat]),
        helper.make_node("Shape", [main.output[0]], [f"{prefix}_shape"]),
        helper.make_node("Reshape", [flat, f"{prefix}_shape"], [correction]),
        helper.make_node("Add", [main.output[0], correction], [output]),
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
