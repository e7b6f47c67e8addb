"""One rank's model from its shard set: an encoder's forward (worker/tp/runtime.py) or the
LLM engine's step (worker/tp/llm_step.py), by the manifest's kind."""

from __future__ import annotations

from common.shard_format import ENCODER, LLM
from worker.runtime import RuntimeOptions
from worker.tp.llm_step import RankSteps
from worker.tp.runtime import RankModel, ShardSet, ShardSetError


def load_rank(shards: ShardSet, rank: int, options: RuntimeOptions, providers: list[str]):  # type: ignore[no-untyped-def]
    """This rank's part of a shard set: RankModel (encoder) or RankSteps (LLM engine)."""
    if shards.kind == ENCODER:
        return RankModel(shards, rank, options, providers)
    if shards.kind == LLM:
        return RankSteps(shards, rank, options, providers)
    raise ShardSetError(
        f"{shards.root}: a {shards.kind!r} shard set is no longer served (decoders run the LLM "
        f"engine's step graph); rebuild it with `python -m quantize shard --model "
        f"{shards.model} --tp {shards.tp}`"
    )
