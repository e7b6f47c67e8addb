"""Speculative decoding's draft side: a small model proposes a sequence's next tokens,
greedily, from its own KV cache; the engine's target model then verifies them all in one run
(worker/llm/step.py's `_speculate`).

The draft cache has the target's slots and length: a sequence lives in the same slot of
both. Tokens past a sequence's length are dead (attention reads up to each row's length), so
a rejected draft is rolled back by not advancing the length, in both caches. The draft
learns a sequence's tokens lazily: each proposal starts by feeding it every token it has not
seen (the whole prompt the first time, then the last token, or two when all drafts were kept
since the last of them never went through the draft model), so a sequence that never
speculates costs the draft nothing. A verify run writes up to k tokens past what a sequence
keeps, so its cache pages may reach k tokens past its reservation (in both caches); the
draft's cache adds its own bytes per token to the KV budget's memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from worker.llm.cache import KVCache
from worker.llm.model import Model


@dataclass(frozen=True)
class DraftConfig:
    model: Model
    num_tokens: int  # k: tokens proposed per step


class Drafter:
    def __init__(self, config: DraftConfig, slots: int, max_len: int, budget: int) -> None:
        f = config.model.facts
        self.model = config.model
        self.num_tokens = config.num_tokens
        self.cache = KVCache(f.cache_shape(slots, max_len), budget)
        self.ns = 0  # time in the draft's runs

    def propose(self, pending: list[int], length: int, slot: int, k: int) -> list[int]:
        """k greedy tokens after a sequence of `length` tokens whose last `pending` ones are
        not in the draft's cache yet."""
        start = time.perf_counter_ns()
        drafts: list[int] = []
        ids = np.asarray([pending], np.int64)
        for i in range(k):
            logits = self.model.run(self.cache, ids, np.asarray([length + i]), slot, slot + 1)
            drafts.append(int(logits[0].argmax()))
            ids = np.asarray([drafts[-1:]], np.int64)
        # the last draft is never fed back: the target verifies it, and a next proposal
        # feeds it when it was kept
        self.ns += time.perf_counter_ns() - start
        return drafts

    def release(self, slot: int) -> None:
        self.cache.discard(slot)

    def close(self) -> None:
        self.cache.close()
