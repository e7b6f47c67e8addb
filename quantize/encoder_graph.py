"""The sentence encoder as the worker serves it: BERT built from onnxruntime's fused ops.

torch.onnx's export (dynamo) of `quantize/models.py`'s BertEncoder spelled each layer out
op by op: per-head Reshape/Transpose, two scaled MatMuls, Softmax, an Erf-based GELU, Add +
LayerNorm. onnxruntime's transformer fusions did not recognise that export's attention
pattern, and on a CPU those small ops took 43% of an int8 forward pass (MiniLM, batch 16,
onnxruntime's profiler: the MatMuls were quantized, the glue around them was not). This
graph is written with the fused ops instead, the layout onnxruntime's BERT optimizer
produces for its own exports:

    Attention                q/k/v as one [hidden, 3 x hidden] projection, the padding mask,
                             softmax(QK^T / sqrt(d)) V per head, in one kernel
    SkipLayerNormalization   LayerNorm(x + residual + bias)
    BiasGelu                 GELU(x + bias), exact (erf), as torch's default

so dynamic int8 quantizes the attention projection too (QAttention). Same contract as the
export (worker/text.py): input_ids, attention_mask [batch, seq] int64 ->
sentence_embedding [batch, hidden], mean-pooled over real tokens and unit length. Each
weight is an initializer named after its torch parameter ([in, out] for projections).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from quantize.llm_graph import IR_VERSION, OPSET, Graph
from quantize.models import BertEncoder

INPUTS = IDS, MASK = ("input_ids", "attention_mask")
EMBEDDING = "sentence_embedding"
NORM_FLOOR = 1e-12  # torch.nn.functional.normalize's eps
COUNT_FLOOR = 1e-9  # quantize/models.py mean_pool's clamp


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def embeddings(g: Graph, state: Mapping[str, torch.Tensor], eps: float) -> str:
    """LayerNorm(word[id] + position[i] + token_type[0]); token type 0 is folded into the
    position table, whose rows 0..seq-1 are sliced off."""
    word = g.one("Gather", [g.const("word.weight", _array(state["word.weight"])), IDS])
    table = _array(state["position.weight"]) + _array(state["token_type.weight"])[0]
    seq = g.one("Shape", [IDS], start=1, end=2)
    start = g.const("zero", np.array([0], np.int64))
    # a Slice, not a Gather of Range(0, seq): onnxruntime 1.23's extended optimizations
    # turn that Gather into a Slice with scalar starts, which then fails at run time
    positions = g.one("Slice", [g.const("position.weight", table), start, seq])
    x = g.one("Add", [word, positions])
    gamma = g.const("embed_norm.weight", _array(state["embed_norm.weight"]))
    beta = g.const("embed_norm.bias", _array(state["embed_norm.bias"]))
    return g.one("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=eps)


def layer(
    g: Graph, x: str, mask: str, state: Mapping[str, torch.Tensor], i: int, heads: int, eps: float
) -> str:
    """Layer i: Attention, o, SkipLayerNorm; up, BiasGelu, down, SkipLayerNorm."""
    p = f"layers.{i}."

    def param(name: str, transpose: bool = False) -> str:
        """The torch parameter layers.i.<name> as an initializer ([in, out] if transposed)."""
        array = _array(state[p + name])
        return g.const(p + name, array.T if transpose else array)

    qkv_weight = np.concatenate([_array(state[p + f"{n}.weight"]).T for n in "qkv"], axis=1)
    qkv_bias = np.concatenate([_array(state[p + f"{n}.bias"]) for n in "qkv"])
    qkv = [g.const(p + "qkv.weight", qkv_weight), g.const(p + "qkv.bias", qkv_bias)]
    attended = g.one("Attention", [x, *qkv, mask], num_heads=heads)

    def skip_norm(h: str, residual: str, linear: str, norm: str) -> str:
        """LayerNorm(h @ W + b + residual) with the projection's bias inside the norm."""
        projected = g.one("MatMul", [h, param(linear + ".weight", transpose=True)])
        norm_and_bias = [param(norm + ".weight"), param(norm + ".bias"), param(linear + ".bias")]
        return g.one("SkipLayerNormalization", [projected, residual, *norm_and_bias], epsilon=eps)

    x = skip_norm(attended, x, "o", "attn_norm")
    up = g.one("MatMul", [x, param("up.weight", transpose=True)])
    hidden = g.one("BiasGelu", [up, param("up.bias")])
    return skip_norm(hidden, x, "down", "ffn_norm")


def mean_pool(g: Graph, x: str) -> str:
    """Mean over the real tokens, divided by its L2 norm (floored as torch's normalize).
    The floors are Clip(min), not Max: the fp16 recipe's converter keeps Max in float32
    and then mismatches it with its float16 input."""
    weights = g.one("Cast", [MASK], to=TensorProto.FLOAT)
    per_token = g.one("Unsqueeze", [weights, g.const("last_axis", np.array([2], np.int64))])
    axis = g.const("seq_axis", np.array([1], np.int64))
    summed = g.one("ReduceSum", [g.one("Mul", [x, per_token]), axis], keepdims=0)
    count = g.one("ReduceSum", [weights, axis], keepdims=1)
    count = g.one("Clip", [count, g.const("count_floor", np.array(COUNT_FLOOR, np.float32))])
    pooled = g.one("Div", [summed, count])
    norm = g.one("ReduceL2", [pooled], axes=[-1], keepdims=1)  # opset 17: axes an attribute
    norm = g.one("Clip", [norm, g.const("norm_floor", np.array(NORM_FLOOR, np.float32))])
    return g.one("Div", [pooled, norm])


def build(model: BertEncoder) -> onnx.ModelProto:
    """The fused-op graph of `model`'s weights (fp32)."""
    c = model.config
    state = dict(model.state_dict())
    g = Graph()
    x = embeddings(g, state, c.eps)
    mask = g.one("Cast", [MASK], to=TensorProto.INT32)  # Attention's 2-D raw mask
    for i in range(c.layers):
        x = layer(g, x, mask, state, i, c.heads, c.eps)
    g.nodes.append(helper.make_node("Identity", [mean_pool(g, x)], [EMBEDDING], name="embedding"))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in INPUTS]
    outputs = [helper.make_tensor_value_info(EMBEDDING, TensorProto.FLOAT, ["batch", c.hidden])]
    graph = helper.make_graph(g.nodes, "meshserve_encoder", inputs, outputs, g.initializers)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        ir_version=IR_VERSION,
        producer_name="meshserve.quantize.encoder_graph",
    )


def save(proto: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(path))
    return path
