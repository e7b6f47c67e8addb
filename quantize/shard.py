"""Megatron-style tensor-parallel shards of our BertEncoder, as ONNX segments.

Per rank the model is cut at its all-reduce points into segments, each one small ONNX graph:

    first      embeddings (replicated) + layer 0's attention partial
    L{i}.mlp   residual + norm of the reduced attention partial, then the MLP partial
    L{i}.attn  residual + norm of the reduced MLP partial, then layer i's attention partial
    head       the last residual + norm, then pooling

Attention heads are divided across ranks: q/k/v and MLP-up are column-parallel (a rank keeps
its rows of the weight), attention-out and MLP-down row-parallel (its columns, no bias: the
replicated bias is added once, after the reduce, in the next segment). Embeddings and norms
are replicated. A decoder is sharded as the LLM engine's step graph instead
(quantize/llm_shard.py, the same cut over an in-place KV cache).

Tensor-name contract with worker/tp/runtime.py: an output `partial` is all-reduced into
`reduced`; `X_out` becomes `X`; anything else keeps its name.

Written into a model repository as DIR/<model>/<version>/tp<N>/{manifest.json, rank<r>/*.onnx}.
The manifest lists ranks, files, sha256 checksums and weight bytes; the worker verifies it.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.shard_format import ENCODER, FORMAT, MANIFEST, sha256, shard_dir
from quantize.models import (
    BertEncoder,
    BertLayer,
    LlamaDecoder,
    attention,
    bert_inputs,
    gelu_mlp,
    mean_pool,
)

OPSET = 17


class ShardError(Exception):
    """The model cannot be split this way; the message says why and what would work."""


def valid_tp_sizes(heads: int, kv_heads: int, up_to: int = 64) -> list[int]:
    return [n for n in range(1, up_to + 1) if heads % n == 0 and kv_heads % n == 0]


def check_tp(name: str, heads: int, kv_heads: int, tp: int) -> None:
    if tp < 1 or heads % tp or kv_heads % tp:
        kv = f" and {kv_heads} KV heads" if kv_heads != heads else ""
        raise ShardError(
            f"{name}: TP size {tp} does not divide its {heads} attention heads{kv}; "
            f"valid TP sizes: {valid_tp_sizes(heads, kv_heads)}"
        )


# ---- slicing -------------------------------------------------------------------------


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """Column-parallel: output features start:stop (and their bias)."""
    out = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None)
    out.weight = nn.Parameter(linear.weight.detach()[start:stop].clone())
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach()[start:stop].clone())
    return out


def _cols(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """Row-parallel: input features start:stop, no bias (added once, after the reduce)."""
    out = nn.Linear(stop - start, linear.out_features, bias=False)
    out.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())
    return out


def _bias(linear: nn.Linear) -> torch.Tensor:
    b = linear.bias
    return torch.zeros(linear.out_features) if b is None else b.detach().clone()


# ---- encoder segments ----------------------------------------------------------------


class BertAttnPart(nn.Module):
    def __init__(self, layer: BertLayer, rank: int, tp: int) -> None:
        super().__init__()
        self.head_dim = layer.head_dim
        width = layer.heads // tp * layer.head_dim
        lo, hi = rank * width, (rank + 1) * width
        self.q, self.k, self.v = (_rows(m, lo, hi) for m in (layer.q, layer.k, layer.v))
        self.o = _cols(layer.o, lo, hi)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return attention(self, x, bias)


class BertMlpPart(nn.Module):
    def __init__(self, layer: BertLayer, rank: int, tp: int) -> None:
        super().__init__()
        width = layer.up.out_features // tp
        self.up = _rows(layer.up, rank * width, (rank + 1) * width)
        self.down = _cols(layer.down, rank * width, (rank + 1) * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_mlp(self, x)


class EncFirst(nn.Module):
    def __init__(self, model: BertEncoder, rank: int, tp: int) -> None:
        super().__init__()
        self.word, self.position = model.word, model.position
        self.token_type, self.embed_norm = model.token_type, model.embed_norm
        self.attn = BertAttnPart(model.layers[0], rank, tp)  # type: ignore[arg-type]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):  # type: ignore[no-untyped-def]
        x, bias = bert_inputs(self, input_ids, attention_mask)
        return x, bias, self.attn(x, bias)


class EncMlp(nn.Module):
    o_bias: torch.Tensor

    def __init__(self, layer: BertLayer, rank: int, tp: int) -> None:
        super().__init__()
        self.register_buffer("o_bias", _bias(layer.o))
        self.norm = layer.attn_norm
        self.mlp = BertMlpPart(layer, rank, tp)

    def forward(self, hidden: torch.Tensor, reduced: torch.Tensor):  # type: ignore[no-untyped-def]
        x = self.norm(hidden + reduced + self.o_bias)
        return x, self.mlp(x)


class EncAttn(nn.Module):
    down_bias: torch.Tensor

    def __init__(self, prev: BertLayer, layer: BertLayer, rank: int, tp: int) -> None:
        super().__init__()
        self.register_buffer("down_bias", _bias(prev.down))
        self.norm = prev.ffn_norm
        self.attn = BertAttnPart(layer, rank, tp)

    def forward(self, hidden: torch.Tensor, reduced: torch.Tensor, bias: torch.Tensor):  # type: ignore[no-untyped-def]
        x = self.norm(hidden + reduced + self.down_bias)
        return x, self.attn(x, bias)


class EncHead(nn.Module):
    down_bias: torch.Tensor

    def __init__(self, last: BertLayer) -> None:
        super().__init__()
        self.register_buffer("down_bias", _bias(last.down))
        self.norm = last.ffn_norm

    def forward(  # type: ignore[no-untyped-def]
        self, hidden: torch.Tensor, reduced: torch.Tensor, attention_mask: torch.Tensor
    ):
        return mean_pool(self.norm(hidden + reduced + self.down_bias), attention_mask)


# ---- the segment plan ----------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    name: str
    module: nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    example: tuple[torch.Tensor, ...]


# Dynamic axes by tensor name (layer suffixes stripped).
_B, _S, _T = "batch", "seq", "total"
AXES = {
    "input_ids": {0: _B, 1: _S},
    "attention_mask": {0: _B, 1: _T},
    "hidden": {0: _B, 1: _S},
    "hidden_out": {0: _B, 1: _S},
    "reduced": {0: _B, 1: _S},
    "partial": {0: _B, 1: _S},
    "bias": {0: _B, 2: _S, 3: _T},
    "sentence_embedding": {0: _B},
}


def _axes(name: str) -> dict[int, str]:
    base = name.rsplit("_", 1)[0] if name[-1].isdigit() else name
    return AXES[base]


def encoder_plan(model: BertEncoder, rank: int, tp: int) -> list[Segment]:
    c = model.config
    check_tp("encoder", c.heads, c.heads, tp)
    b, s = 2, 5
    ids = torch.randint(0, c.vocab_size, (b, s))
    mask = torch.ones(b, s, dtype=torch.int64)
    x = torch.randn(b, s, c.hidden)
    bias = torch.zeros(b, 1, 1, s)
    layers: list[BertLayer] = list(model.layers)  # type: ignore[arg-type]
    plan = [
        Segment(
            "first",
            EncFirst(model, rank, tp),
            ("input_ids", "attention_mask"),
            ("hidden", "bias", "partial"),
            (ids, mask),
        )
    ]
    for i, layer in enumerate(layers):
        if i > 0:
            plan.append(
                Segment(
                    f"L{i}.attn",
                    EncAttn(layers[i - 1], layer, rank, tp),
                    ("hidden", "reduced", "bias"),
                    ("hidden_out", "partial"),
                    (x, x, bias),
                )
            )
        plan.append(
            Segment(
                f"L{i}.mlp",
                EncMlp(layer, rank, tp),
                ("hidden", "reduced"),
                ("hidden_out", "partial"),
                (x, x),
            )
        )
    plan.append(
        Segment(
            "head",
            EncHead(layers[-1]),
            ("hidden", "reduced", "attention_mask"),
            ("sentence_embedding",),
            (x, x, mask),
        )
    )
    return plan


def plan_for(model: nn.Module, rank: int, tp: int) -> list[Segment]:
    if isinstance(model, BertEncoder):
        return encoder_plan(model, rank, tp)
    if isinstance(model, LlamaDecoder):
        raise ShardError(
            "a decoder is sharded as the LLM engine's step graph: quantize/llm_shard.py "
            "(`python -m quantize shard --model smollm2 --tp 3`)"
        )
    raise ShardError(f"cannot shard {type(model).__name__}: not a BertEncoder")


# ---- export and manifest ---------------------------------------------------------------


def export_segment(segment: Segment, path: Path) -> None:
    """The legacy (TorchScript) exporter: a 30-layer decoder is ~60 graphs per rank, and it
    exports each in a fraction of a second where the dynamo exporter takes seconds."""
    names = [*segment.inputs, *segment.outputs]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            segment.module.eval(),
            segment.example,
            str(path),
            input_names=list(segment.inputs),
            output_names=list(segment.outputs),
            dynamic_axes={n: _axes(n) for n in names},
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )


def _param_bytes(module: nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _sharded_bytes(plan: list[Segment], model: nn.Module, tp: int) -> int:
    """Bytes of the rank's weights that are split across ranks (q/k/v/o, MLP, vocab head)."""
    total = 0
    for seg in plan:
        for name, p in seg.module.named_parameters():
            leaf = name.split(".")[-2] if "." in name else name
            if leaf in {"q", "k", "v", "o", "up", "gate", "down"}:
                total += p.numel() * p.element_size()
    return total


def io_of(model: BertEncoder) -> tuple[list[dict], list[dict]]:
    """What the TP worker serves: token ids in, an embedding out."""
    return (
        [
            {"name": "input_ids", "datatype": "INT64", "dims": [-1]},
            {"name": "attention_mask", "datatype": "INT64", "dims": [-1]},
        ],
        [{"name": "sentence_embedding", "datatype": "FP32", "dims": [model.config.hidden]}],
    )


def file_record(segment: str, path: Path, staged: Path) -> dict[str, Any]:
    """A written file as the manifest lists it (the worker verifies its size and checksum)."""
    return {
        "segment": segment,
        "path": str(path.relative_to(staged)),
        "sha256": sha256(path),
        "bytes": path.stat().st_size,
    }


def segment_records(segments: Sequence[Any]) -> list[dict[str, Any]]:
    """The segments' names and tensor names, the same on every rank."""
    return [
        {"name": s.name, "inputs": list(s.inputs), "outputs": list(s.outputs)} for s in segments
    ]


def stage_shard_set(target: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Writes a shard set so that it appears complete or not at all: `build(staged)` writes
    every rank's files under `staged` and returns the manifest, then the folder is renamed
    over `target`. Returns the manifest's path."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        manifest = build(staged)
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if target.exists():
            target.replace(Path(tmp) / "old")
        staged.replace(target)
    return target / MANIFEST


def write_shards(model: nn.Module, name: str, model_dir: Path, tp: int, version: str = "1") -> Path:
    """Every rank's segments and the manifest (stage_shard_set); returns the manifest's path."""
    model = model.eval()
    plans = [plan_for(model, r, tp) for r in range(tp)]  # refuses a bad TP size up front

    def build(staged: Path) -> dict[str, Any]:
        ranks: list[dict[str, Any]] = []
        for rank, plan in enumerate(plans):
            folder = staged / f"rank{rank}"
            folder.mkdir(parents=True)
            files = []
            for seg in plan:
                path = folder / f"{seg.name}.onnx"
                export_segment(seg, path)
                files.append(file_record(seg.name, path, staged))
            ranks.append(
                {
                    "rank": rank,
                    "weight_bytes": sum(_param_bytes(s.module) for s in plan),
                    "sharded_bytes": _sharded_bytes(plan, model, tp),
                    "files": files,
                }
            )
        inputs, outputs = io_of(model)  # type: ignore[arg-type]
        return {
            "format": FORMAT,
            "model": name,
            "kind": ENCODER,
            "tp": tp,
            "config": dataclasses.asdict(model.config),  # type: ignore[call-overload]
            "segments": segment_records(plans[0]),
            "inputs": inputs,
            "outputs": outputs,
            # per-rank weights ~ replicated + sharded / tp: lets a refusal suggest a TP size
            "replicated_bytes": ranks[0]["weight_bytes"] - ranks[0]["sharded_bytes"],
            "sharded_bytes": sum(r["sharded_bytes"] for r in ranks),
            "ranks": ranks,
        }

    return stage_shard_set(shard_dir(model_dir, version, tp), build)
