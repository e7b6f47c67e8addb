"""The decoder as the LLM engine runs it: one step graph over a server-owned KV cache.

`quantize/models.py`'s LlamaDecoder passes the whole cache in and out of every step, which
costs O(context) copies per token. The engine's graph instead takes the cache as BNSH
buffers [rows, kv_heads, max_len, head_dim] that the worker allocates once and binds as both
`past_key.{i}` and `present_key.{i}` (onnxruntime's com.microsoft GroupQueryAttention writes
the new keys in place at each row's own length: `seqlens_k` = past + new - 1). RoPE runs
inside the attention op from cos/sin tables baked into the graph, so positions follow each
row's length and no row is ever padded. Only the last position reaches the LM head, so a
prefill of 1,500 tokens returns one row of logits, not 1,500.

Inputs: input_ids [rows, new] int64, seqlens_k [rows] int32, total_sequence_length []
int32, past_key.{i} / past_value.{i}. Outputs: logits [rows, vocab] float32, present_key.{i}
/ present_value.{i} (the same buffers). Every projection is a MatMul with its weight as an
initializer [in, out] named after the torch parameter (`layers.3.q.weight`, `lm_head.weight`),
so the weight-only quantizers (MatMulNBits) apply to it unchanged. The shape facts the engine
needs are in the model's metadata (`meshserve.llm.*`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from quantize.models import DecoderConfig, LlamaDecoder

OPSET = 17
IR_VERSION = 10  # onnxruntime 1.23 reads IR <= 11; onnx 1.19 writes 12 by default
META = "meshserve.llm."
IDS, SEQLENS, TOTAL, LOGITS = "input_ids", "seqlens_k", "total_sequence_length", "logits"


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key.{layer}", f"past_value.{layer}"


def present_names(layer: int) -> tuple[str, str]:
    return f"present_key.{layer}", f"present_value.{layer}"


def rope_tables(c: DecoderConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class _Graph:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, **attrs) -> list[str]:  # type: ignore[no-untyped-def]
        self._n += 1
        names = [f"{op_type.lower()}_{self._n}_{i}" for i in range(outputs)]
        domain = "com.microsoft" if op_type == "GroupQueryAttention" else ""
        self.nodes.append(
            helper.make_node(
                op_type, inputs, names, name=f"{op_type}_{self._n}", domain=domain, **attrs
            )
        )
        return names

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:  # type: ignore[no-untyped-def]
        return self.op(op_type, inputs, **attrs)[0]

    def rms_norm(self, x: str, weight: str, eps: float) -> str:
        return self.one("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps)

    def linear(self, x: str, weight: str, w: torch.Tensor) -> str:
        """x @ W^T with the torch weight [out, in] stored as an initializer [in, out]."""
        return self.one("MatMul", [x, self.const(weight, w.detach().float().numpy().T)])


def build(model: LlamaDecoder, max_positions: int) -> onnx.ModelProto:
    """The engine's step graph for `model`'s weights, with RoPE tables for max_positions."""
    c = model.config
    state = {k: v for k, v in model.state_dict().items()}
    g = _Graph()
    cos, sin = rope_tables(c, max_positions)
    g.const("rope.cos", cos)
    g.const("rope.sin", sin)
    x = g.one("Gather", [g.const("embed.weight", state["embed.weight"].numpy()), IDS])
    inputs = [
        helper.make_tensor_value_info(IDS, TensorProto.INT64, ["rows", "new"]),
        helper.make_tensor_value_info(SEQLENS, TensorProto.INT32, ["rows"]),
        helper.make_tensor_value_info(TOTAL, TensorProto.INT32, []),
    ]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["rows", c.vocab_size])]
    cache_shape: list[str | int | None] = ["rows", c.kv_heads, "max_len", c.head_dim]
    for i in range(c.layers):
        p = f"layers.{i}."
        h = g.rms_norm(
            x, g.const(p + "attn_norm.weight", state[p + "attn_norm.weight"].numpy()), c.eps
        )
        q = g.linear(h, p + "q.weight", state[p + "q.weight"])
        k = g.linear(h, p + "k.weight", state[p + "k.weight"])
        v = g.linear(h, p + "v.weight", state[p + "v.weight"])
        past_k, past_v = past_names(i)
        present_k, present_v = present_names(i)
        g.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [q, k, v, past_k, past_v, SEQLENS, TOTAL, "rope.cos", "rope.sin"],
                [f"attn_{i}", present_k, present_v],
                name=f"attention_{i}",
                domain="com.microsoft",
                num_heads=c.heads,
                kv_num_heads=c.kv_heads,
                do_rotary=1,
                rotary_interleaved=0,
            )
        )
        for name in (past_k, past_v):
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, cache_shape))
        for name in (present_k, present_v):
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, cache_shape))
        x = g.one("Add", [x, g.linear(f"attn_{i}", p + "o.weight", state[p + "o.weight"])])
        h = g.rms_norm(
            x, g.const(p + "ffn_norm.weight", state[p + "ffn_norm.weight"].numpy()), c.eps
        )
        gate = g.linear(h, p + "gate.weight", state[p + "gate.weight"])
        up = g.linear(h, p + "up.weight", state[p + "up.weight"])
        silu = g.one("Mul", [gate, g.one("Sigmoid", [gate])])
        x = g.one(
            "Add",
            [x, g.linear(g.one("Mul", [silu, up]), p + "down.weight", state[p + "down.weight"])],
        )
    last = g.one("Gather", [x, g.const("last_position", np.array(-1, np.int64))], axis=1)
    last = g.one("Reshape", [last, g.const("rows_by_hidden", np.array([-1, c.hidden], np.int64))])
    h = g.rms_norm(last, g.const("norm.weight", state["norm.weight"].numpy()), c.eps)
    # The LM head gets its own [in, out] copy even when tied to the embedding: the Gather
    # reads rows of the fp32 table, while the quantizers can then shrink the head's MatMul.
    logits = g.linear(h, "lm_head.weight", state["lm_head.weight"])
    g.nodes.append(helper.make_node("Identity", [logits], [LOGITS], name="logits"))
    graph = helper.make_graph(g.nodes, "meshserve_llm_step", inputs, outputs, g.initializers)
    proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        ir_version=IR_VERSION,
        producer_name="meshserve.quantize.llm_graph",
    )
    meta = {
        "layers": c.layers,
        "heads": c.heads,
        "kv_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_positions": max_positions,
    }
    helper.set_model_props(proto, {META + k: str(v) for k, v in meta.items()})
    return proto


def save(proto: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(path))
    return path
