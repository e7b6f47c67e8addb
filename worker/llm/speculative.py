"""Speculative decoding's draft side: something proposes a sequence's next tokens, and the
engine's target model verifies them all in one run (worker/llm/step.py's `_speculate`).
Two proposers:

- **A draft model** (`DraftConfig`, `Drafter`): a small step graph proposes k tokens
  greedily from its own KV cache. The draft cache has the target's slots and length: a
  sequence lives in the same slot of both. Tokens past a sequence's length are dead
  (attention reads up to each row's length), so a rejected draft is rolled back by not
  advancing the length, in both caches. The draft learns a sequence's tokens lazily: each
  proposal starts by feeding it every token it has not seen (the whole prompt the first
  time, then the last token, or two when all drafts were kept since the last of them never
  went through the draft model), so a sequence that never speculates costs the draft
  nothing. A verify run writes up to k tokens past what a sequence keeps, so its cache pages
  may reach k tokens past its reservation (in both caches); the draft's cache adds its own
  bytes per token to the KV budget's memory.
- **n-gram lookup** (`NgramConfig`, `NgramProposer`; vLLM's `ngram` method, prompt lookup
  decoding): the sequence's own tokens, prompt and output, are the draft. The last n tokens
  (n from max_n down to min_n) are looked up earlier in the sequence; the tokens that
  followed their latest earlier occurrence are the proposal (up to k; where that runs into
  the sequence's end, the proposal continues itself, as a repeat does). No model, no cache,
  microseconds per proposal; nothing found, no verify run: the step decodes as without
  speculation. It pays where text repeats what came before: code and documents quoted or
  edited, summaries, a small model's loops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from worker.llm.cache import KVCache
from worker.llm.model import Model
from worker.llm.scheduler import Sequence


@dataclass(frozen=True)
class DraftConfig:
    model: Model
    num_tokens: int  # k: tokens proposed per step


@dataclass(frozen=True)
class NgramConfig:
    num_tokens: int = 4  # k: tokens proposed per step, at most
    min_n: int = 1  # the shortest suffix looked up (vLLM's prompt_lookup_min)
    max_n: int = 3  # the longest (prompt_lookup_max), tried first

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"n-gram lookup sizes: expected 1 <= min <= max, got min {self.min_n}, "
                f"max {self.max_n}"
            )


SpeculativeConfig = DraftConfig | NgramConfig


class Proposer(Protocol):
    num_tokens: int
    ns: int  # time spent proposing
    runs_model: bool  # propose() runs a model: on the step thread, not the event loop

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to follow `seq` (none: no speculation this step)."""
        ...

    def release(self, slot: int) -> None: ...

    def close(self) -> None: ...


def proposer(config: SpeculativeConfig, slots: int, max_len: int) -> Proposer:
    if isinstance(config, NgramConfig):
        return NgramProposer(config)
    return Drafter(config, slots, max_len)


class Drafter:
    runs_model = True

    def __init__(self, config: DraftConfig, slots: int, max_len: int) -> None:
        f = config.model.facts
        self.model = config.model
        self.num_tokens = config.num_tokens
        self.cache = KVCache(f.cache_shape(slots, max_len), self.model.cache_device)
        self.ns = 0  # time in the draft's runs

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """k greedy tokens after `seq`, whose tokens from `seq.drafted` on are not in the
        draft's cache yet."""
        start = time.perf_counter_ns()
        drafts: list[int] = []
        ids = np.asarray([seq.since(seq.drafted)], np.int64)
        for i in range(k):
            lengths = np.asarray([seq.length + i])
            logits = self.model.run(self.cache, ids, lengths, seq.slot, seq.slot + 1)
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


class NgramProposer:
    runs_model = False

    def __init__(self, config: NgramConfig) -> None:
        self.num_tokens = config.num_tokens
        self.min_n, self.max_n = config.min_n, config.max_n
        self.ns = 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        start = time.perf_counter_ns()
        try:
            return lookup(np.asarray([*seq.prompt, *seq.tokens]), self.min_n, self.max_n, k)
        finally:
            self.ns += time.perf_counter_ns() - start

    def release(self, slot: int) -> None:
        pass

    def close(self) -> None:
        pass


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of min_n..max_n tokens (continuing the proposal itself where they reach the
    end); [] when no such suffix occurs earlier."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows ending before the last token: each has at least one token after it
        windows = sliding_window_view(tokens[:-1], n)
        found = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if found.size:
            source = int(found[-1]) + n
            out: list[int] = []
            for i in range(source, source + k):
                out.append(int(tokens[i]) if i < size else out[i - size])
            return out
    return []
