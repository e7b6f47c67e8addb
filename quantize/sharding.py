"""`python -m quantize shard --model M --tp N`: real weights cut into a tp<N> shard set for
each N: an encoder by quantize/shard.py, a decoder (the LLM engine's step graph) by
quantize/llm_shard.py, with a config.pbtxt when the model folder has none."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from common import model_keys
from common.model_config import config_text
from quantize import llm, llm_shard, pipeline
from quantize.models import LlamaDecoder
from quantize.shard import check_tp, write_shards


def heads_of(model: nn.Module) -> tuple[int, int]:
    c: Any = model.config
    return c.heads, getattr(c, "kv_heads", c.heads)


# ---- the CLI step: python -m quantize shard --model M --tp N ---------------------------


def truncate(model: nn.Module, layers: int) -> nn.Module:
    """The first `layers` layers of a loaded model (tests and quick checks on real weights)."""
    c: Any = model.config
    if layers >= c.layers:
        return model
    model.layers = nn.ModuleList(list(model.layers)[:layers])  # type: ignore[arg-type]
    model.config = dataclasses.replace(c, layers=layers)
    return model


def shard_model(
    name: str,
    tps: list[int],
    output: Path,
    layers: int | None = None,
    version: str = "1",
    serve_as: str | None = None,
) -> list[Path]:
    """Load the real weights of `name` (quantize/pipeline.py SOURCES), write a tp<N> shard set
    for each N into OUTPUT/<serve_as or name>/<version>/, and a config.pbtxt when there is
    none. An encoder's group serves token ids (no text parameters); a decoder's is the LLM
    engine's step graph (quantize/llm_shard.py), served with Triton's vLLM-backend tensors."""
    source = pipeline.source(name)
    loaded = source.load()
    model = loaded.model
    heads, kv = heads_of(model)
    for tp in tps:  # refuse before any slow export
        check_tp(name, heads, kv, tp)
    if layers:
        model = truncate(model, layers)
    serve_as = serve_as or name
    if isinstance(model, LlamaDecoder):  # a decoder is served by the LLM engine
        return llm_shard.write_model(
            model, loaded.tokenizer, serve_as, output, tps, llm.MAX_POSITIONS
        )
    model_dir = output / serve_as
    model_dir.mkdir(parents=True, exist_ok=True)
    if not (model_dir / "config.pbtxt").exists():
        params = {k: v for k, v in source.config.items() if k != model_keys.TEXT_TASK}
        (model_dir / "config.pbtxt").write_text(
            config_text(serve_as, source.max_batch_size, source.max_queue_delay_us, params)
        )
    return [write_shards(model, serve_as, model_dir, tp, version) for tp in tps]
