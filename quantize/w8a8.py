"""W8A8 for the decoder's step graph: int8 weights per output channel times int8 activations
per row (token), through onnxruntime's MatMulIntegerToFloat, which runs MLAS's u8s8 QGEMM.

Why: at 16-32 rows MatMulNBits' int8 kernel computes rather than reads, and on a CPU with
AMX the QGEMM is about twice as fast there; decode steps of 16-32 rows take about 0.8x the
time, one row the same (docs/decisions.md, "W8A8 where the CPU has AMX"). The QGEMM is exact
only where the CPU has VNNI (without it, vpmaddubsw saturates int16 pairs), so the recipe is
built and served where the CPU has the flag its rule names (quantize/llm.BY_CPU).

The starting point is the int8 weight-only graph (every projection an 8-bit MatMulNBits in
blocks; its embedding already 8-bit). Each projection is rewritten from its dequantized
blocks, except the MLP's down projections. Per-row activation scales alone fail the gate on
SmolLM2 (a few input channels run to 10-40x the median, the down projections' up to ~1,865x,
and set every row's scale), so three things keep the accuracy:

- smoothing (SmoothQuant, alpha 0.5): an RMSNorm output's channel j is divided by
  c_j = sqrt(amax_j / wmax_j), folded into the norm's weight, and the projections reading it
  take row j times c_j, so part of an outlier channel's range moves into the weights;
- outlier channels in fp32: an input whose largest calibrated channel is over OUTLIER_RATIO
  times the median keeps its OUTLIERS largest channels out of the int8 path (zeroed there)
  and multiplies them in fp32 (Gather, MatMul, Add);
- the down projections stay MatMulNBits: their inputs (SiLU(gate) * up) have the widest
  outliers, and they are a quarter of a layer's weights.

Calibration: per-channel amax of every projection input over prefill runs of Python's
language reference (`pydoc_data`), not the gate's set.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from quantize.embedding import MS_DOMAIN

ALPHA = 0.5
OUTLIER_RATIO = 10.0
OUTLIERS = 8
CALIBRATION_TEXTS = 40
CALIBRATION_TOKENS = 256
NORMS = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}  # gamma's input
DOWN = re.compile(r"layers\.\d+\.down\.weight")
ZERO_POINT = 128  # activations: round(x / s) + 128 in 1..255, s = row amax / 127


def is_down(node: onnx.NodeProto) -> bool:
    return bool(DOWN.match(node.input[1]))


def dequantized(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> np.ndarray:
    """An 8-bit MatMulNBits' weight as fp32 [K, N]: scale * (code - zero point) per block."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    if a["bits"] != 8:
        raise ValueError(f"{node.name}: {a['bits']}-bit MatMulNBits; the W8A8 rewrite takes 8")
    k, n = a["K"], a["N"]
    codes = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)  # [N, blocks, blk]
    scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, -1, 1)
    zero = 2 ** (a["bits"] - 1)
    if len(node.input) > 3 and node.input[3]:
        raise ValueError(f"{node.name}: explicit zero points; the rewrite takes symmetric blocks")
    w = ((codes - zero) * scales).reshape(n, -1)[:, :k]
    return np.ascontiguousarray(w.T)


def calibrate(src: Path, tokenizer: Path) -> dict[str, np.ndarray]:
    """Per-channel amax of the input of every projection of the step graph at SRC (fp32):
    {activation name: [K]}, over prefill runs of CALIBRATION_TEXTS topics of `pydoc_data`."""
    import pydoc_data.topics

    from tokenizers import Tokenizer

    from quantize import evaluate

    model = onnx.load(str(src))
    inits = {i.name for i in model.graph.initializer}
    names = list(
        dict.fromkeys(
            n.input[0]
            for n in model.graph.node
            if n.op_type in ("MatMul", "MatMulNBits") and n.input[1] in inits
        )
    )
    tok = Tokenizer.from_file(str(tokenizer))
    texts = [t for _, t in sorted(pydoc_data.topics.topics.items())][:CALIBRATION_TEXTS]
    sequences = [tok.encode(text).ids[:CALIBRATION_TOKENS] for text in texts]
    return evaluate.activation_amax(model, names, sequences)


def rewrite(model: onnx.ModelProto, amax: dict[str, np.ndarray]) -> int:
    """Rewrite MODEL's 8-bit MatMulNBits (all but the down projections) in place as per-row
    W8A8 (module docstring); returns how many were rewritten."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers = Counter(i for n in g.node for i in n.input)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        if n.op_type == "MatMulNBits" and not is_down(n):
            readers.setdefault(n.input[0], []).append(n)
    weights = {n.name: dequantized(n, inits) for ns in readers.values() for n in ns}

    # smoothing: folded into the norm's gamma, multiplied into the projections' rows
    for x, nodes in readers.items():
        norm = producer.get(x)
        if norm is None or norm.op_type not in NORMS or norm.output[0] != x:
            continue
        if consumers[x] != len(nodes):
            continue  # read by something else too, which the fold would change
        wmax = np.max([np.abs(weights[n.name]).max(1) for n in nodes], axis=0)
        c = np.sqrt(np.maximum(amax[x], 1e-5) / np.maximum(wmax, 1e-5)).astype(np.float32)
        gamma = inits[norm.input[NORMS[norm.op_type]]]
        array = numpy_helper.to_array(gamma)
        gamma.CopyFrom(numpy_helper.from_array((array / c).astype(array.dtype), gamma.name))
        for n in nodes:
            weights[n.name] *= c[:, None]

    nodes_out: list[onnx.NodeProto] = []
    added = [
        numpy_helper.from_array(np.array(1 / 127, np.float32), "w8a8.inv127"),
        numpy_helper.from_array(np.array(1e-30, np.float32), "w8a8.tiny"),
        # + 0.5 then Cast's truncation: round half up, into 1..255
        numpy_helper.from_array(np.array(ZERO_POINT + 0.5, np.float32), "w8a8.zero_half"),
        numpy_helper.from_array(np.array(ZERO_POINT, np.uint8), "w8a8.zero"),
    ]
    quantized: dict[str, tuple[str, str, np.ndarray | None]] = {}
    dropped: set[str] = set()

    def quantize_input(x: str) -> tuple[str, str, np.ndarray | None]:
        """Per-row uint8 codes and scales of X, and its outlier channels (None: none): those
        are masked out of the codes and gathered once, as `{x}.w8a8_outlier_values`."""
        a = amax[x]
        outliers = None
        src = x
        if a.max() > OUTLIER_RATIO * np.median(a):
            outliers = np.sort(np.argsort(a)[::-1][:OUTLIERS]).astype(np.int64)
            mask = np.ones(a.shape, np.float32)
            mask[outliers] = 0
            added.append(numpy_helper.from_array(mask, f"{x}.w8a8_mask"))
            added.append(numpy_helper.from_array(outliers, f"{x}.w8a8_outliers"))
            src = f"{x}.w8a8_inliers"
            nodes_out.append(helper.make_node("Mul", [x, f"{x}.w8a8_mask"], [src]))
            nodes_out.append(
                helper.make_node(
                    "Gather", [x, f"{x}.w8a8_outliers"], [f"{x}.w8a8_outlier_values"], axis=-1
                )
            )
        p = f"{x}.w8a8"
        nodes_out.extend(
            [
                helper.make_node("Abs", [src], [p + "_abs"]),
                helper.make_node("ReduceMax", [p + "_abs"], [p + "_amax"], axes=[-1], keepdims=1),
                helper.make_node("Max", [p + "_amax", "w8a8.tiny"], [p + "_amax_pos"]),
                helper.make_node("Mul", [p + "_amax_pos", "w8a8.inv127"], [p + "_scale"]),
                helper.make_node("Div", [src, p + "_scale"], [p + "_scaled"]),
                helper.make_node("Add", [p + "_scaled", "w8a8.zero_half"], [p + "_shifted"]),
                helper.make_node("Cast", [p + "_shifted"], [p + "_codes"], to=TensorProto.UINT8),
            ]
        )
        return p + "_codes", p + "_scale", outliers

    for node in g.node:
        if node.name not in weights:
            nodes_out.append(node)
            continue
        x, out, p = node.input[0], node.output[0], node.name
        if x not in quantized:
            quantized[x] = quantize_input(x)
        codes, scale, outliers = quantized[x]
        w = weights[node.name]
        dropped.update(i for i in node.input[1:] if i)
        if outliers is not None:
            added.append(numpy_helper.from_array(w[outliers], f"{p}.w8a8_rows"))
            w = w.copy()
            w[outliers] = 0
        w_scale = (np.maximum(np.abs(w).max(0), 1e-30) / 127).astype(np.float32)
        w_codes = np.clip(np.round(w / w_scale), -127, 127).astype(np.int8)
        added.append(numpy_helper.from_array(w_codes, f"{p}.w8a8_weight"))
        added.append(numpy_helper.from_array(w_scale, f"{p}.w8a8_weight_scale"))
        inputs = [codes, f"{p}.w8a8_weight", scale, f"{p}.w8a8_weight_scale", "w8a8.zero"]
        if outliers is None:
            nodes_out.append(
                helper.make_node("MatMulIntegerToFloat", inputs, [out], p, domain=MS_DOMAIN)
            )
            continue
        nodes_out.extend(
            [
                helper.make_node(
                    "MatMulIntegerToFloat", inputs, [f"{p}.w8a8_int"], p, domain=MS_DOMAIN
                ),
                helper.make_node(
                    "MatMul", [f"{x}.w8a8_outlier_values", f"{p}.w8a8_rows"], [f"{p}.w8a8_y"]
                ),
                helper.make_node("Add", [f"{p}.w8a8_int", f"{p}.w8a8_y"], [out]),
            ]
        )
    kept = [i for i in g.initializer if i.name not in dropped]
    del g.node[:]
    g.node.extend(nodes_out)
    del g.initializer[:]
    g.initializer.extend(kept + added)
    return len(weights)


def apply(src: Path, dst: Path) -> None:
    """Rewrite the 8-bit weight-only graph at DST in place, calibrated on its fp32 parent at
    SRC (whose tokenizer.json lies beside it)."""
    amax = calibrate(src, src.with_name("tokenizer.json"))
    model = onnx.load(str(dst))
    rewrite(model, amax)
    onnx.save(model, str(dst))
