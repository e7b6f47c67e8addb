"""The LLM engine's step graph (quantize/llm_graph.py) split for tensor parallelism.

Rank r of N holds heads/N query heads and kv_heads/N KV heads of every layer (q/k/v and
MLP gate/up column-parallel: its rows of the weight; attention-out and MLP-down
row-parallel: its columns), and its own KV cache of those KV heads, written in place by the
attention op exactly as in the unsharded graph. The graph is cut at the two all-reduces per
layer into segments, each a small ONNX graph built with llm_graph's own pieces:

    first      embedding (replicated) + layer 0's attention share        -> partial
    L{i}.mlp   hidden + reduced (the residual), layer i's MLP share      -> partial
    L{i}.attn  hidden + reduced, layer i's attention share (i >= 1)      -> partial
    head       hidden + reduced, last position, final norm, this rank's vocabulary slice
               of the LM head                                            -> logits_shard

The embedding and the norms are replicated (the residual stream is the same on every rank);
the LM head is vocab-parallel — its rows padded with zeros to a multiple of N — and the
shards are gathered on rank 0, the leader, which alone samples. worker/tp/llm_step.py runs them.

Tensor names: an output `partial` is all-reduced into the next segment's `reduced`;
`hidden_out` becomes the next `hidden`; the cache is past_key.{i}/present_key.{i} (bound to
the same buffer), with seqlens_k and total_sequence_length as in the unsharded graph.
RoPE's cos/sin tables are inputs of the attention segments, bound once per rank from
rank<r>/rope.npz (as initializers, every layer's graph would hold its own copy: 2 MB a layer
for SmolLM2's 8,192 positions). Written as DIR/<model>/<version>/tp<N>/{manifest.json,
rank<r>/*.onnx, rank<r>/rope.npz} (the manifest of quantize/shard.py, kind "llm"), next to
the model's tokenizer.json and decoupled config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from tokenizers import Tokenizer

from common.shard_format import (
    FORMAT,
    HIDDEN,
    HIDDEN_OUT,
    LLM,
    PARTIAL,
    REDUCED,
    ROPE_FILE,
    shard_dir,
)
from common.shard_format import LOGITS_SHARD as SHARD
from quantize import llm_graph as lg
from quantize.models import DecoderConfig, LlamaDecoder
from quantize.shard import (
    ShardError,
    check_tp,
    file_record,
    segment_records,
    stage_shard_set,
)

KIND = LLM
ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"  # llm_graph's names; a file per rank here
COLUMN_PARALLEL = ("q", "k", "v", "gate", "up")  # a rank keeps rows of [out, in]
ROW_PARALLEL = ("o", "down")  # a rank keeps columns


@dataclasses.dataclass(frozen=True)
class Segment:
    name: str
    proto: onnx.ModelProto
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def rank_state(model: LlamaDecoder, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The weights rank `rank` of `tp` holds, named as in the unsharded model."""
    c = model.config
    hd = c.head_dim
    q_width, kv_width = c.heads // tp * hd, c.kv_heads // tp * hd
    mlp_width = c.intermediate // tp
    widths = {"q": q_width, "k": kv_width, "v": kv_width, "gate": mlp_width, "up": mlp_width}
    widths |= {"o": q_width, "down": mlp_width}
    state: dict[str, torch.Tensor] = {}
    for name, w in model.state_dict().items():
        w = w.detach().float()
        parts = name.split(".")
        leaf = parts[-2] if len(parts) >= 2 else ""
        if name.startswith("layers.") and leaf in widths:
            lo, hi = rank * widths[leaf], (rank + 1) * widths[leaf]
            w = w[lo:hi] if leaf in COLUMN_PARALLEL else w[:, lo:hi]
        elif name == "lm_head.weight":
            vocab = padded_vocab(c.vocab_size, tp)
            if vocab > c.vocab_size:
                w = torch.cat([w, torch.zeros(vocab - c.vocab_size, w.shape[1])])
            width = vocab // tp
            w = w[rank * width : (rank + 1) * width]
        state[name] = w.contiguous()
    return state


def _hidden_info(name: str, c: DecoderConfig) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", "new", c.hidden])


def _segment(
    g: lg.Graph,
    name: str,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[tuple[str, onnx.ValueInfoProto]],
    meta: Mapping[str, object],
) -> Segment:
    """Name the graph's results (value -> output name) and wrap it as one segment."""
    infos = []
    for value, info in outputs:
        if value != info.name:
            g.nodes.append(helper.make_node("Identity", [value], [info.name], name=info.name))
        infos.append(info)
    proto = lg.model_proto(g, f"meshserve_llm_{name}", inputs, infos, meta)
    return Segment(name, proto, tuple(i.name for i in inputs), tuple(i.name for i in infos))


def plan(model: LlamaDecoder, rank: int, tp: int, max_positions: int) -> list[Segment]:
    """Rank `rank`'s segments of the step graph, in execution order."""
    c = model.config
    check_tp("decoder", c.heads, c.kv_heads, tp)
    if c.head_dim % 16:
        raise ShardError(
            f"head_dim {c.head_dim}: GroupQueryAttention on CPU needs a multiple of 16"
        )
    state = rank_state(model, rank, tp)
    heads, kv_heads = c.heads // tp, c.kv_heads // tp
    meta = {"rank": rank, "tp": tp}
    segments = []

    rope = [  # inputs, bound to one table per rank (not an initializer in every layer's graph)
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [max_positions, c.head_dim // 2])
        for n in (ROPE_COS, ROPE_SIN)
    ]

    def attention_segment(name: str, layer: int, first: bool) -> Segment:
        g = lg.Graph()
        inputs = [*lg.step_inputs(), *rope]
        if first:
            x, skip, out = lg.embed(g, state), None, HIDDEN
        else:  # the residual add (hidden + the reduced partials) runs in the norm's node
            inputs = [_hidden_info(HIDDEN, c), _hidden_info(REDUCED, c), *inputs[1:]]
            x, skip, out = HIDDEN, REDUCED, HIDDEN_OUT
        past, present = lg.cache_info(layer, kv_heads, c.head_dim)
        partial, x = lg.attention(g, x, state, layer, heads, kv_heads, c.eps, skip=skip)
        outs = [(x, _hidden_info(out, c)), (partial, _hidden_info(PARTIAL, c))]
        outs += [(p.name, p) for p in present]
        return _segment(g, name, [*inputs, *past], outs, meta)

    def mlp_segment(layer: int) -> Segment:
        g = lg.Graph()
        partial, x = lg.mlp(g, HIDDEN, state, layer, c.eps, skip=REDUCED)
        inputs = [_hidden_info(HIDDEN, c), _hidden_info(REDUCED, c)]
        outs = [(x, _hidden_info(HIDDEN_OUT, c)), (partial, _hidden_info(PARTIAL, c))]
        return _segment(g, f"L{layer}.mlp", inputs, outs, meta)

    segments.append(attention_segment("first", 0, first=True))
    for i in range(c.layers):
        if i > 0:
            segments.append(attention_segment(f"L{i}.attn", i, first=False))
        segments.append(mlp_segment(i))
    g = lg.Graph()
    x = g.one("Add", [HIDDEN, REDUCED])
    logits = lm_head_info(c, tp)
    head = lg.lm_head(g, x, state, c.hidden, c.eps)
    inputs = [_hidden_info(HIDDEN, c), _hidden_info(REDUCED, c)]
    segments.append(_segment(g, "head", inputs, [(head, logits)], meta))
    return segments


def lm_head_info(c: DecoderConfig, tp: int) -> onnx.ValueInfoProto:
    width = padded_vocab(c.vocab_size, tp) // tp
    return helper.make_tensor_value_info(SHARD, TensorProto.FLOAT, ["rows", width])


def _weight_bytes(proto: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in proto.graph.initializer)


def _sharded_bytes(proto: onnx.ModelProto) -> int:
    split = {*COLUMN_PARALLEL, *ROW_PARALLEL, "qkv", "gate_up", "lm_head"}  # fused in the graph
    return sum(
        len(t.raw_data)
        for t in proto.graph.initializer
        if t.name.endswith(".weight") and t.name.split(".")[-2] in split
    )


def write(
    model: LlamaDecoder, name: str, model_dir: Path, tp: int, max_positions: int, version: str = "1"
) -> Path:
    """Every rank's segments and the manifest (quantize/shard.py's stage_shard_set);
    returns the manifest's path."""
    model = model.eval()
    c = model.config
    plans = [plan(model, r, tp, max_positions) for r in range(tp)]  # refuses a bad TP first
    cos, sin = lg.rope_tables(c, max_positions)

    def build(staged: Path) -> dict[str, Any]:
        ranks: list[dict[str, Any]] = []
        for rank, segments in enumerate(plans):
            folder = staged / f"rank{rank}"
            folder.mkdir(parents=True)
            np.savez(folder / ROPE_FILE, cos=cos, sin=sin)
            paths = [(s.name, lg.save(s.proto, folder / f"{s.name}.onnx")) for s in segments]
            files = [
                file_record(segment, path, staged)
                for segment, path in [*paths, ("rope", folder / ROPE_FILE)]
            ]
            ranks.append(
                {
                    "rank": rank,
                    "weight_bytes": sum(_weight_bytes(s.proto) for s in segments)
                    + cos.nbytes
                    + sin.nbytes,
                    "sharded_bytes": sum(_sharded_bytes(s.proto) for s in segments),
                    "files": files,
                }
            )
        return {
            "format": FORMAT,
            "model": name,
            "kind": KIND,
            "tp": tp,
            "config": dataclasses.asdict(c),
            "max_positions": max_positions,
            "vocab_padded": padded_vocab(c.vocab_size, tp),
            "segments": segment_records(plans[0]),
            "replicated_bytes": ranks[0]["weight_bytes"] - ranks[0]["sharded_bytes"],
            "sharded_bytes": sum(r["sharded_bytes"] for r in ranks),
            "ranks": ranks,
        }

    return stage_shard_set(shard_dir(model_dir, version, tp), build)


def write_model(
    model: LlamaDecoder,
    tokenizer: Tokenizer,
    name: str,
    output: Path,
    tps: list[int],
    max_positions: int,
    max_model_len: int = 2048,
    version: str = "1",
) -> list[Path]:
    """OUTPUT/<name>/ as a shard group serves an LLM: tokenizer.json, a decoupled LLM
    config.pbtxt (kept when there is one) and a tp<N> shard set per N."""
    from quantize import llm

    for tp in tps:  # refuse before any slow export
        check_tp(name, model.config.heads, model.config.kv_heads, tp)
    model_dir = output / name
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    if not (model_dir / "config.pbtxt").exists():
        (model_dir / "config.pbtxt").write_text(llm.config_text(name, "fp32", max_model_len))
    return [write(model, name, model_dir, tp, max_positions, version) for tp in tps]
