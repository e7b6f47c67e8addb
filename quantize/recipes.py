"""Quantization recipes: what each does to an fp32 ONNX file, what it is for, and its gate.

Every threshold a quantized artifact must meet lives here, next to the recipe it guards.
Metric names are the keys evaluate.py reports.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from common.step_graph import LM_HEAD_WEIGHT
from quantize.embedding import quantize_gathers

ENCODER = "encoder"
DECODER = "decoder"


@dataclass(frozen=True)
class Threshold:
    metric: str
    op: str  # ">=" or "<="
    value: float

    def passes(self, measured: float) -> bool:
        return {">=": operator.ge, "<=": operator.le}[self.op](measured, self.value)

    def describe(self, measured: float) -> str:
        return f"{self.metric} = {measured:.4f}, threshold {self.op} {self.value}"


@dataclass(frozen=True)
class Recipe:
    name: str
    kind: str  # ENCODER or DECODER: which models it applies to
    purpose: str
    gate: tuple[Threshold, ...]
    # fp32 .onnx -> quantized .onnx; None: the distilled student itself, as exported
    apply: Callable[[Path, Path], None] | None
    provider: str = "CPUExecutionProvider"  # where the gate evaluates it
    # distillation (quantize/distill.py): a student with this many of the teacher's layers,
    # trained against it; `apply` then runs on the student's fp32 export, not the teacher's
    student_layers: int | None = None


def _int8_dynamic(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(src),
        str(dst),
        weight_type=QuantType.QInt8,
        per_channel=True,
        # Attention: the encoder graph's fused q/k/v projection (QAttention)
        op_types_to_quantize=["MatMul", "Gemm", "Attention"],
        # DefaultTensorType: shape inference cannot type what the LLM step graph's contrib
        # ops (GroupQueryAttention) produce; every activation there is float.
        extra_options={"MatMulConstBOnly": True, "DefaultTensorType": 1},  # TensorProto.FLOAT
    )


# The decoder's 8-bit weight-only blocks: 64 weights per scale, 128 in the LM head (its
# largest MatMul): faster steps than 32 and a gate passed with room, where 128 everywhere
# failed greedy match (docs/decisions.md, "Block size 64 for int8 weights").
DECODER_INT8_BLOCK = 64
DECODER_INT8_HEAD_BLOCK = 128


def _weight_only(
    bits: int, block_size: int, head_block_size: int | None = None
) -> Callable[[Path, Path], None]:
    """onnxruntime's MatMulNBits quantizer, symmetric, accuracy_level 4, in blocks of
    block_size; the LM head's MatMul (if the graph has one) in blocks of head_block_size."""

    def quantized(model: onnx.ModelProto, block: int, only: list[str] | None) -> onnx.ModelProto:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )

        config = DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=True, accuracy_level=4, bits=bits
        )
        # its nodes_to_include adds to the op types quantized, so `only` excludes the rest
        others = [] if only is None else [n.name for n in model.graph.node if n.name not in only]
        quantizer = MatMulNBitsQuantizer(
            model,
            block_size=block,
            is_symmetric=True,
            accuracy_level=4,
            nodes_to_exclude=others,
            algo_config=config,
        )
        quantizer.process()
        return quantizer.model.model

    def apply(src: Path, dst: Path) -> None:
        model = onnx.load(str(src))
        head = [
            n.name for n in model.graph.node if n.op_type == "MatMul" and LM_HEAD_WEIGHT in n.input
        ]
        if head_block_size and head:  # the head first; the pass after leaves MatMulNBits be
            model = quantized(model, head_block_size, head)
        model = quantized(model, block_size, None)
        quantize_gathers(model)  # the embedding table too: MatMulNBits covers the MatMuls only
        onnx.save(model, str(dst))

    return apply


_int8_weight_only = _weight_only(8, DECODER_INT8_BLOCK, DECODER_INT8_HEAD_BLOCK)


def _w8a8(src: Path, dst: Path) -> None:
    """decoder-int8-weight-only's graph, then its projections rewritten (quantize/w8a8.py)."""
    from quantize import w8a8

    _int8_weight_only(src, dst)
    w8a8.apply(src, dst)


def _gguf_exact_int4(src: Path, dst: Path) -> None:
    """quantize/int4.py: Q4_1 blocks stay the very 4-bit codes the GGUF holds (zero point
    plus residual, exact), Q8_0 blocks stay 8-bit; weights with no such grid: int4 RTN."""
    from quantize.int4 import quantize_matmuls

    model = onnx.load(str(src))
    quantize_matmuls(model, accuracy_level=4, otherwise="int4")
    quantize_gathers(model)  # SmolLM2's tied Q8_0 embedding: its own codes again
    onnx.save(model, str(dst))


def _fp16(src: Path, dst: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    onnx.save(model, str(dst))


ENCODER_GATE = (
    Threshold("mean_cosine", ">=", 0.99),
    Threshold("min_cosine", ">=", 0.98),
    Threshold("ranking_kept", ">=", 1.0),
)
DECODER_GATE = (
    Threshold("top1_agreement", ">=", 0.9),
    Threshold("kl_divergence", "<=", 0.1),
    Threshold("greedy_match", ">=", 0.6),
)

# A distilled student is judged against the fp32 teacher, like any recipe, but it is a
# different network: half the layers cannot reproduce the teacher's embeddings to int8's
# 0.99. What it may lose: a few points of cosine (it is trained for minutes on ~3k
# sentences, not the teacher's 1B pairs), so the bar is the 0.95 mean and 0.85 for
# the worst sentence; what it may not lose is the order of the evaluation set's triplets
# (which of two sentences is closer to a third), the property a search index relies on.
# Nearest neighbours are reported (nearest_neighbour_kept), not gated: for sentences of
# the set with no close partner ("Quantum computers use qubits.") the nearest is a near-tie
# that the teacher itself decides by a hair.
DISTILLED_ENCODER_GATE = (
    Threshold("mean_cosine", ">=", 0.95),
    Threshold("min_cosine", ">=", 0.85),
    Threshold("triplet_order_kept", ">=", 1.0),
)
# A decoder student with fewer layers can follow the teacher's next token where the
# teacher is confident (facts in the set: "Paris") and drift elsewhere; its greedy text
# then leaves the teacher's after a few tokens, so greedy match is reported, not gated.
# The bar asks that it still speaks the teacher's distribution: top-1 agreement on the
# teacher's own continuations >= 0.5 and KL <= 1.5 nats. Measured once: the default
# 15-layer student after 100 steps has top-1 0.19 and KL 3.69, refused (see README).
DISTILLED_DECODER_GATE = (
    Threshold("top1_agreement", ">=", 0.5),
    Threshold("kl_divergence", "<=", 1.5),
)

DISTILL_NAME = re.compile(r"^(encoder|decoder)-distill-l([1-9][0-9]*)(-int8)?$")


def distill_recipe(kind: str, layers: int, int8: bool) -> Recipe:
    """The student of `layers` layers (fp32), or distill-then-quantize (int8 on top)."""
    name = f"{kind}-distill-l{layers}" + ("-int8" if int8 else "")
    gate = DISTILLED_ENCODER_GATE if kind == ENCODER else DISTILLED_DECODER_GATE
    what = (
        "a sentence encoder trained to match the teacher's embeddings (cosine)"
        if kind == ENCODER
        else "a decoder trained to match the teacher's next-token distributions (KL)"
    )
    purpose = (
        f"Distillation: the teacher's architecture with {layers} of its layers (evenly "
        f"spaced, initialised from the teacher's), {what}; judged against the fp32 teacher."
    )
    if not int8:
        return Recipe(name, kind, purpose, gate, None, student_layers=layers)
    int8_apply = _int8_dynamic if kind == ENCODER else _weight_only(8, 32)
    purpose += (
        " Then int8 on top: "
        + ("dynamic int8 as encoder-int8-dynamic" if kind == ENCODER else "8-bit weight-only")
        + ". Both losses count against the same gate."
    )
    return Recipe(name, kind, purpose, gate, int8_apply, student_layers=layers)


def lookup(name: str) -> Recipe | None:
    """A recipe by name: the fixed ones, or `<kind>-distill-l<K>[-int8]` for any K."""
    if name in RECIPES:
        return RECIPES[name]
    match = DISTILL_NAME.match(name)
    if match is None:
        return None
    kind, layers, int8 = match.groups()
    return distill_recipe(kind, int(layers), bool(int8))


RECIPES = {
    r.name: r
    for r in (
        Recipe(
            "encoder-int8-dynamic",
            ENCODER,
            "CPU serving of embeddings: int8 weights per output channel, activations "
            "quantized on the fly (MatMulInteger, and QAttention for the fused q/k/v "
            "projection); 4x smaller MatMul weights, ~2-4x faster on x86 CPUs with VNNI/AVX2.",
            ENCODER_GATE,
            _int8_dynamic,
        ),
        Recipe(
            "encoder-fp16",
            ENCODER,
            "GPU serving: half the bytes, tensor cores. On a CPU onnxruntime casts around "
            "most fp16 nodes, so it is slower there; the gate still checks its accuracy.",
            ENCODER_GATE,
            _fp16,
        ),
        Recipe(
            "decoder-int8-weight-only",
            DECODER,
            "CPU/GPU serving of the decoder: MatMul weights in 8-bit blocks of 64, the LM "
            "head's of 128 (MatMulNBits, accuracy_level 4 = int8 compute), the embedding "
            "table in 8-bit blocks too (GatherBlockQuantized); activations stay float, so "
            "the KV cache and the causal mask keep full range. Decode steps read every "
            "weight, and this quarters their bytes.",
            DECODER_GATE,
            _int8_weight_only,
        ),
        Recipe(
            "decoder-w8a8",
            DECODER,
            "CPU serving of many rows on a CPU with AMX: the int8 weight-only graph with its "
            "projections (all but the MLP's down) as int8 weights per output channel times "
            "int8 activations per row (MatMulIntegerToFloat: MLAS's u8s8 QGEMM, about "
            "twice MatMulNBits' speed at 16-32 rows there), the RMSNorm outputs smoothed "
            "into the weights and each input's outlier channels kept in fp32 "
            "(quantize/w8a8.py). Exact only on a CPU with VNNI, so it is built and served "
            "by CPU flag (quantize/llm.BY_CPU).",
            DECODER_GATE,
            _w8a8,
        ),
        Recipe(
            "decoder-int4-weight-only",
            DECODER,
            "Memory-bound decode where bytes matter most: the GGUF's own Q4_1 blocks of 32 "
            "as 4-bit MatMulNBits (integer zero point + per-block residual, so the weights "
            "are reproduced exactly), its Q8_0 tensors (the tied lm_head) as 8-bit; "
            "accuracy_level 4 (int8 activations, as llama.cpp's Q4_1 x Q8_1 dot). "
            "Re-quantizing the dequantized weights (the former recipe, symmetric) rounds "
            "every weight a second time: top-1 0.63, refused; so does keeping the GGUF's "
            "codes and scales with the zero point rounded to an integer (top-1 0.64).",
            DECODER_GATE,
            _gguf_exact_int4,
        ),
        Recipe(
            "decoder-int8-dynamic",
            DECODER,
            "Kept as the known-harmful baseline: dynamic int8 (activations too) on a real "
            "decoder. The gate is expected to refuse it.",
            DECODER_GATE,
            _int8_dynamic,
        ),
        Recipe(
            "decoder-fp16",
            DECODER,
            "GPU serving of the decoder: half the bytes. Slow on CPU.",
            DECODER_GATE,
            _fp16,
        ),
    )
}
# The default students: MiniLM 6 -> 4 layers, SmolLM2 30 -> 15 (see quantize/distill.py).
for _kind, _layers in ((ENCODER, 4), (DECODER, 15)):
    for _int8 in (False, True):
        _r = distill_recipe(_kind, _layers, _int8)
        RECIPES[_r.name] = _r
