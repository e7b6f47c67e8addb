"""The decoder as the LLM engine runs it: one step graph over a server-owned KV cache.

`quantize/models.py`'s LlamaDecoder passes the whole cache in and out of every step, which
costs O(context) copies per token. The engine's graph instead takes the cache as BNSH
buffers [rows, kv_heads, max_len, head_dim] that the worker allocates once and binds as both
`past_key.{i}` and `present_key.{i}` (onnxruntime's com.microsoft GroupQueryAttention writes
the new keys in place at each row's own length: `seqlens_k` = past + new - 1). RoPE runs
inside the attention op from cos/sin tables baked into the graph, so positions follow each
row's length and no row is ever padded. Only the last position reaches the LM head, so a
prefill of 1,500 tokens returns one row of logits, not 1,500. With `all_positions`
(`with_position_logits`), an extra scalar input `num_logits` says how many of the last new
positions reach the head instead: logits [rows, num_logits, vocab] (and top_values /
top_ids [rows, num_logits, TOP_K]), what a speculative decoding verify run reads (every
drafted position at once); metadata `num_logits_input` = 1. Served graphs have it
(`save_served`), so any served model can verify drafts.

Inputs: input_ids [rows, new] int64, seqlens_k [rows] int32, total_sequence_length []
int32, past_key.{i} / past_value.{i}. Outputs: logits [rows, vocab] float32, top_values /
top_ids [rows, TOP_K] (the graph's own top-k of them, so a greedy or top-k row copies 64
values, not the vocabulary), present_key.{i} / present_value.{i} (the same buffers, float32
or float16: `kv_dtype`). q/k/v are one packed MatMul (`layers.3.qkv.weight`, read by the
attention op as packed QKV) and gate/up one (`layers.3.gate_up.weight`, then a Split): two
MatMuls fewer per layer. Every projection is a MatMul with its weight as an initializer
[in, out], so the weight-only quantizers (MatMulNBits) apply to it unchanged. The shape
facts the engine needs are in the model's metadata (`meshserve.llm.*`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from common.step_graph import (
    IDS,
    LM_HEAD_WEIGHT,
    LOGITS,
    META,
    NUM_LOGITS,
    POSITIONS,
    SEQLENS,
    TOP_IDS,
    TOP_K,
    TOP_VALUES,
    TOTAL,
    past_names,
    present_names,
)
from quantize.models import DecoderConfig, LlamaDecoder, inv_freq

OPSET = 17
IR_VERSION = 10  # onnxruntime 1.23 reads IR <= 11; onnx 1.19 writes 12 by default

INT64_MAX = np.iinfo(np.int64).max


def rope_tables(c: DecoderConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, head_dim / 2] with the model's RoPE scaling (models.inv_freq),
    times head_dim ** -1/4: RoPE rotates both q and k, so q.k comes out already scaled by
    attention's 1 / sqrt(head_dim) and the attention op runs with scale 1 (QK_SCALE)."""
    freq = inv_freq(c).numpy()
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * freq[None]
    cos, sin = (c.head_dim**-0.25 * np.stack([np.cos(angles), np.sin(angles)])).astype(np.float32)
    return cos, sin


# GroupQueryAttention's own scale of q.k: 1, since the RoPE tables carry 1 / sqrt(head_dim);
# with alpha 1 MLAS takes its one-row SGEMM for a decode row's q.k, not a packed full SGEMM
# (docs/decisions.md, "Attention scale folded into the RoPE tables").
QK_SCALE = 1.0


# com.microsoft ops onnxruntime implements (its contrib ops); everything else is ONNX's own
CONTRIB_OPS = frozenset(
    {
        "GroupQueryAttention",
        "Attention",
        "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "BiasGelu",
    }
)


class Graph:
    """Nodes and initializers of a graph built by hand (here and in encoder_graph.py)."""

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
        domain = "com.microsoft" if op_type in CONTRIB_OPS else ""
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

    def add_rms_norm(self, x: str, skip: str | None, weight: str, eps: float) -> tuple[str, str]:
        """(rms_norm(x + skip), x + skip): the residual add and the next norm as one node
        (com.microsoft SkipSimplifiedLayerNormalization, whose fourth output is the sum),
        since onnxruntime does not fuse them itself; without skip, (rms_norm(x), x)."""
        if skip is None:
            return self.rms_norm(x, weight, eps), x
        self._n += 1
        normed, total = f"skip_norm_{self._n}_0", f"skip_norm_{self._n}_3"
        self.nodes.append(
            helper.make_node(
                "SkipSimplifiedLayerNormalization",
                [x, skip, weight],
                [normed, "", "", total],
                name=f"SkipSimplifiedLayerNormalization_{self._n}",
                domain="com.microsoft",
                epsilon=eps,
            )
        )
        return normed, total

    def linear(self, x: str, weight: str, w: torch.Tensor) -> str:
        """x @ W^T with the torch weight [out, in] stored as an initializer [in, out]."""
        return self.one("MatMul", [x, self.const(weight, w.detach().float().numpy().T)])


KV_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def cache_info(
    layer: int, kv_heads: int, head_dim: int, kv_dtype: str = "float32"
) -> tuple[list, list]:
    """Layer `layer`'s cache as graph inputs (past) and outputs (present): BNSH buffers."""
    shape: list[str | int] = ["rows", kv_heads, "max_len", head_dim]
    kind = KV_TYPES[kv_dtype]
    past = [helper.make_tensor_value_info(n, kind, shape) for n in past_names(layer)]
    present = [helper.make_tensor_value_info(n, kind, shape) for n in present_names(layer)]
    return past, present


def step_inputs() -> list[onnx.ValueInfoProto]:
    return [
        helper.make_tensor_value_info(IDS, TensorProto.INT64, ["rows", "new"]),
        helper.make_tensor_value_info(SEQLENS, TensorProto.INT32, ["rows"]),
        helper.make_tensor_value_info(TOTAL, TensorProto.INT32, []),
    ]


def embed(g: Graph, state: Mapping[str, torch.Tensor]) -> str:
    return g.one("Gather", [g.const("embed.weight", state["embed.weight"].numpy()), IDS])


def attention(
    g: Graph,
    x: str,
    state: Mapping[str, torch.Tensor],
    layer: int,
    heads: int,
    kv_heads: int,
    eps: float,
    kv_dtype: str = "float32",
    rope: tuple[str, str] = ("rope.cos", "rope.sin"),
    skip: str | None = None,
) -> tuple[str, str]:
    """Layer `layer`'s attention on x (+ skip, the previous block's output, added in the
    norm's node), as (its output before the residual, the residual stream x + skip): norm,
    one packed q/k/v MatMul (`layers.{i}.qkv.weight`, q rows then k then v; plus their
    biases as in qwen2), the attention op on the packed projection (RoPE from the `rope`
    tables, the cache written in place, in kv_dtype), o. With the q/k/v rows and o columns
    of some heads only, it is those heads' share (tensor parallelism)."""
    p = f"layers.{layer}."
    norm = g.const(p + "attn_norm.weight", state[p + "attn_norm.weight"].numpy())
    h, x = g.add_rms_norm(x, skip, norm, eps)
    parts = [state[p + f"{n}.weight"] for n in ("q", "k", "v")]
    qkv = g.linear(h, p + "qkv.weight", torch.cat(parts))
    if p + "q.bias" in state:
        bias = torch.cat([state[p + f"{n}.bias"] for n in ("q", "k", "v")]).detach().float()
        qkv = g.one("Add", [qkv, g.const(p + "qkv.bias", bias.numpy())])
    half = kv_dtype == "float16"
    if half:
        qkv = g.one("Cast", [qkv], to=TensorProto.FLOAT16)
    past_k, past_v = past_names(layer)
    present_k, present_v = present_names(layer)
    g.nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [qkv, "", "", past_k, past_v, SEQLENS, TOTAL, *rope],
            [f"attn_{layer}", present_k, present_v],
            name=f"attention_{layer}",
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            scale=QK_SCALE,
        )
    )
    out = f"attn_{layer}"
    if half:
        out = g.one("Cast", [out], to=TensorProto.FLOAT)
    return g.linear(out, p + "o.weight", state[p + "o.weight"]), x


def mlp(
    g: Graph,
    x: str,
    state: Mapping[str, torch.Tensor],
    layer: int,
    eps: float,
    skip: str | None = None,
) -> tuple[str, str]:
    """Layer `layer`'s SwiGLU MLP on x (+ skip, added in the norm's node), as (its output
    before the residual, or its share: some gate/up rows and the matching down columns; the
    residual stream x + skip): gate and up as one MatMul (`layers.{i}.gate_up.weight`)."""
    p = f"layers.{layer}."
    norm = g.const(p + "ffn_norm.weight", state[p + "ffn_norm.weight"].numpy())
    h, x = g.add_rms_norm(x, skip, norm, eps)
    gate_w, up_w = state[p + "gate.weight"], state[p + "up.weight"]
    gate_up = g.linear(h, p + "gate_up.weight", torch.cat([gate_w, up_w]))
    width = g.const(p + "gate_up.split", np.array([gate_w.shape[0], up_w.shape[0]], np.int64))
    gate, up = g.op("Split", [gate_up, width], outputs=2, axis=-1)
    silu = g.one("Mul", [gate, g.one("Sigmoid", [gate])])
    return g.linear(g.one("Mul", [silu, up]), p + "down.weight", state[p + "down.weight"]), x


def lm_head(g: Graph, x: str, state: Mapping[str, torch.Tensor], hidden: int, eps: float) -> str:
    """The last position only -> final norm -> the LM head (whatever rows it holds)."""
    last = g.one("Gather", [x, g.const("last_position", np.array(-1, np.int64))], axis=1)
    last = g.one("Reshape", [last, g.const("rows_by_hidden", np.array([-1, hidden], np.int64))])
    h = g.rms_norm(last, g.const("norm.weight", state["norm.weight"].numpy()), eps)
    # The LM head gets its own [in, out] copy even when tied to the embedding: the Gather
    # reads rows of the table (8-bit blocks after quantize/embedding.py), while the
    # quantizers can then shrink the head's MatMul.
    return g.linear(h, LM_HEAD_WEIGHT, state["lm_head.weight"])


def add_rope(g: Graph, c: DecoderConfig, max_positions: int, kv_dtype: str = "float32") -> None:
    cos, sin = rope_tables(c, max_positions)
    kind = np.float16 if kv_dtype == "float16" else np.float32  # the attention op's type
    g.const("rope.cos", cos.astype(kind))
    g.const("rope.sin", sin.astype(kind))


def top_k(g: Graph, logits: str, vocab: int) -> list[onnx.ValueInfoProto]:
    """`top_values` / `top_ids` [rows, k]: the k largest logits of each row, largest first
    (ties: the lower id first, as argmax), so that a greedy or top-k row needs no logits."""
    k = min(TOP_K, vocab)
    g.nodes.append(
        helper.make_node(
            "TopK",
            [logits, g.const("top_k", np.array([k], np.int64))],
            [TOP_VALUES, TOP_IDS],
            name="top_k",
            axis=-1,
            largest=1,
            sorted=1,
        )
    )
    return [
        helper.make_tensor_value_info(TOP_VALUES, TensorProto.FLOAT, ["rows", k]),
        helper.make_tensor_value_info(TOP_IDS, TensorProto.INT64, ["rows", k]),
    ]


def model_proto(
    g: Graph, name: str, inputs: list, outputs: list, meta: Mapping[str, object]
) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        ir_version=IR_VERSION,
        producer_name="meshserve.quantize.llm_graph",
    )
    helper.set_model_props(proto, {META + k: str(v) for k, v in meta.items()})
    return proto


def build(
    model: LlamaDecoder,
    max_positions: int | None = None,
    all_positions: bool = False,
    kv_dtype: str = "float32",
) -> onnx.ModelProto:
    """The engine's step graph for `model`'s weights, with RoPE tables for max_positions
    (default: the model's context length), the KV cache in kv_dtype ("float32" or
    "float16"), and the `num_logits` input with all_positions."""
    c = model.config
    if kv_dtype not in KV_TYPES:
        raise ValueError(f"KV cache dtype {kv_dtype!r}: expected one of {sorted(KV_TYPES)}")
    positions = max_positions or c.context_length
    state = dict(model.state_dict())
    g = Graph()
    add_rope(g, c, positions, kv_dtype)
    x = embed(g, state)
    inputs = step_inputs()
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["rows", c.vocab_size])]
    # Each block's output joins the residual stream in the next block's norm node; the last
    # one in an Add, since the head norms the last position only.
    out = None
    for i in range(c.layers):
        past, present = cache_info(i, c.kv_heads, c.head_dim, kv_dtype)
        inputs += past
        outputs += present
        attn, x = attention(g, x, state, i, c.heads, c.kv_heads, c.eps, kv_dtype, skip=out)
        out, x = mlp(g, x, state, i, c.eps, skip=attn)
    x = g.one("Add", [x, out]) if out is not None else x
    logits = lm_head(g, x, state, c.hidden, c.eps)
    g.nodes.append(helper.make_node("Identity", [logits], [LOGITS], name="logits"))
    outputs += top_k(g, LOGITS, c.vocab_size)
    meta = {
        "layers": c.layers,
        "heads": c.heads,
        "kv_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_positions": positions,
        "kv_dtype": kv_dtype,
    }
    proto = model_proto(g, "meshserve_llm_step", inputs, outputs, meta)
    return with_position_logits(proto) if all_positions else proto


def with_position_logits(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The step graph (fp32 or quantized: only the head's Gather changes) returning logits at
    the last `num_logits` new positions of each row, [rows, num_logits, vocab], and its
    top-k of each, [rows, num_logits, k]; num_logits = 1 gives the last position, as before.
    Modifies and returns `proto`."""
    g = proto.graph
    gather = next(
        (n for n in g.node if n.op_type == "Gather" and n.input[1:] == ["last_position"]), None
    )
    if gather is None:
        raise ValueError("not a last-position step graph (no Gather of last_position)")
    reshape = next(n for n in g.node if n.op_type == "Reshape" and n.input[0] == gather.output[0])
    shape = next(t for t in g.initializer if t.name == reshape.input[1])
    hidden = int(numpy_helper.to_array(shape)[-1])
    consts = {
        "num_logits_shape": np.array([1], np.int64),
        "positions_end": np.array([INT64_MAX], np.int64),
        "positions_axis": np.array([1], np.int64),
        "rows_by_positions_by_hidden": np.array([0, -1, hidden], np.int64),
    }
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    index = list(g.node).index(gather)
    first = "num_logits_first"
    nodes = [
        helper.make_node("Neg", [NUM_LOGITS], ["num_logits_neg"], name="num_logits_neg"),
        helper.make_node(
            "Reshape", ["num_logits_neg", "num_logits_shape"], [first], name="num_logits_first"
        ),
        helper.make_node(
            "Slice",
            [gather.input[0], first, "positions_end", "positions_axis"],
            [gather.output[0]],
            name="last_positions",
        ),
    ]
    g.node.remove(gather)
    g.initializer.remove(next(t for t in g.initializer if t.name == "last_position"))
    for offset, node in enumerate(nodes):
        g.node.insert(index + offset, node)
    reshape.input[1] = "rows_by_positions_by_hidden"
    g.input.append(helper.make_tensor_value_info(NUM_LOGITS, TensorProto.INT64, []))
    logits = next(o for o in g.output if o.name == LOGITS)
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    logits.CopyFrom(
        helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["rows", POSITIONS, vocab])
    )
    # the graph's top-k, if it has one, now runs over each position's logits
    for out in [o for o in g.output if o.name in (TOP_VALUES, TOP_IDS)]:
        t = out.type.tensor_type
        out.CopyFrom(
            helper.make_tensor_value_info(
                out.name, t.elem_type, ["rows", POSITIONS, t.shape.dim[-1].dim_value]
            )
        )
    helper.set_model_props(
        proto,
        {**{p.key: p.value for p in proto.metadata_props}, META + "num_logits_input": "1"},
    )
    return proto


def without_logits_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The LM head's MatMul writes `logits` itself, where `build` names it through an
    Identity: onnxruntime copies that Identity's [rows, vocab] floats every step, though a
    top-k run never reads them. Modifies and returns `proto`; a graph without that Identity
    is returned as it is."""
    g = proto.graph
    copy = next((n for n in g.node if n.op_type == "Identity" and n.output[:] == [LOGITS]), None)
    if copy is None:
        return proto
    source = copy.input[0]
    if any(o.name == source for o in g.output):
        return proto
    g.node.remove(copy)
    for node in g.node:
        node.output[:] = [LOGITS if x == source else x for x in node.output]
        node.input[:] = [LOGITS if x == source else x for x in node.input]
    for info in [v for v in g.value_info if v.name == source]:
        g.value_info.remove(info)
    return proto


def save(proto: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(path))
    return path


WEIGHTS_SUFFIX = ".data"  # a served graph's weights: model.onnx.data beside model.onnx


def served_files(path: Path) -> tuple[Path, Path]:
    """A served step graph's two files: the graph, and its weights beside it."""
    return path, path.with_name(path.name + WEIGHTS_SUFFIX)


def save_served(proto: onnx.ModelProto, path: Path) -> Path:
    """The graph as a worker serves it: nodes in `path`, every weight in one file beside it
    (onnx external data). onnxruntime maps that file instead of reading it into the heap:
    what it prepacks (MatMulNBits) it copies and lets go, and the 8-bit embedding is read
    in place, so only the rows of tokens seen become resident (SmolLM2 int8: session 273 ->
    239 MB, load peak 331 -> 265 MB). The worker's own reads of the graph (index bounds,
    string inputs) parse 100 KB instead of the whole file. With logits at the last
    `num_logits` positions (`with_position_logits`), so that the worker can verify drafts
    (speculative decoding); a plain step reads the same top-k; and the head writing the
    logits output itself (`without_logits_copy`). Empties `proto`'s tensors."""
    if not any(i.name == NUM_LOGITS for i in proto.graph.input):
        with_position_logits(proto)
    without_logits_copy(proto)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = served_files(path)[1]
    weights.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=weights.name,
        size_threshold=1024,
    )
    return path
