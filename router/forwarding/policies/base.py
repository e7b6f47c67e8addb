"""What every balancing policy shares: the candidates it picks from, what a pick knows about
the request, and the `Policy` shape (SGLang's router keeps one object per policy the same way:
`select_worker`, `needs_request_text`).

`load` turns what the router knows about a replica into one number: the queue depth the
worker last published, plus the calls this router sent it after that sample was taken (the
sample cannot include them yet), and never less than this router's own calls in flight to
it: samples arrive within a millisecond now (pushed), and a sample that fresh does not show
the calls still on their way to the worker either. A sample older than `max_age_ms` counts
as unknown and only the router's own in-flight calls remain: acting on stale least-loaded
data makes every router herd onto the same replica (Mitzenmacher, "How useful is old
information?").

KV cache (replicas serving an LLM engine publish the KV tokens their running sequences hold
and their budget): `kv_free` is the budget left as last sampled. An engine admits a sequence
only once its whole reservation (prompt + max_tokens) fits; a request sent to a replica
without room waits there, however short its queue looks (`kv_need`: an average request's
reservation).

Affinity is a filter in front of every policy (`Policy.choose`): the replica that served the
request's session before is taken as long as it is a candidate with room; otherwise the
policy decides as if there were none.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from router.forwarding.prefix_index import PrefixIndex

PREFIX_WEIGHT = 4.0  # a prefilled block costs this many held (decoding) blocks
TOKENS_PER_BLOCK = 16  # a KV sample's tokens -> blocks (a router block is ~16 tokens)


@dataclass(frozen=True)
class Candidate:
    id: str
    load: int
    max_queue: int
    kv_free: int | None = None  # KV tokens free; None: not an LLM replica, or unknown
    overlap: int = 0  # prompt blocks the replica holds (policies that need the prompt)
    decode_blocks: int | None = None  # KV blocks its sequences hold; None: unknown
    key: str = ""  # the replica's key in the prefix index (its id and start time)

    @property
    def full(self) -> bool:
        return self.load >= self.max_queue

    def has_room(self, need: int) -> bool:
        return self.kv_free is None or self.kv_free >= need


@dataclass(frozen=True)
class Ask:
    """What one pick knows besides its candidates."""

    need: int = 1  # KV tokens an average request reserves (kv_need)
    preferred: str | None = None  # the replica that served the request's session before
    blocks: int = 0  # the prompt's blocks (0 unless the policy needs the prompt)
    tick: int = 0  # picks so far, this one included
    keys: tuple[bytes, ...] = ()  # the prompt's block keys, for the policy to record


@dataclass(frozen=True)
class Setup:
    """What a policy is built with: its rng (injected: seeded in tests), the router's prefix
    index (shared with the picker, which reads it) and the prefix cost's weight."""

    rng: random.Random = field(default_factory=random.Random)
    index: PrefixIndex = field(default_factory=PrefixIndex)
    prefix_weight: float = PREFIX_WEIGHT


class Policy(abc.ABC):
    name: ClassVar[str]
    needs_prompt: ClassVar[bool] = False  # the picker reads the prompt and scores overlaps

    def __init__(self, setup: Setup) -> None:
        self.rng = setup.rng

    def choose(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        """One of `candidates` (non-empty, none full): the session's replica while it has
        room, else the policy's own pick."""
        if ask.preferred is not None:
            for c in candidates:
                if c.id == ask.preferred and c.has_room(ask.need):
                    return c
        if len(candidates) == 1:
            return candidates[0]
        return self.select(candidates, ask)

    @abc.abstractmethod
    def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        """The policy's pick among two or more candidates, no session preferred."""

    def picked(self, chosen: Candidate, candidates: Sequence[Candidate], ask: Ask) -> None:
        """What the policy records once it picked (a pure policy records nothing)."""
        return None


def load(
    depth: int | None,
    sampled_ms: int | None,
    inflight_started_ms: Collection[int],
    now_ms: int,
    max_age_ms: int,
) -> int:
    own = len(inflight_started_ms)
    if depth is None or sampled_ms is None or now_ms - sampled_ms > max_age_ms:
        return own
    return max(own, depth + sum(1 for t in inflight_started_ms if t > sampled_ms))


def kv_free(
    kv_used: int, kv_total: int, sampled_ms: int | None, now_ms: int, max_age_ms: int
) -> int | None:
    """Free KV tokens as sampled; None when the replica reports no KV cache or its sample is
    stale (unknown, as for `load`). The calls this router sent since the sample count in
    `load`, not here: their reservations are unknown to the router, and charging each the
    mesh's mean (one long sequence can dominate it) makes an idle replica look full after
    one call, sending a burst to the full one (measured by the kv_balance benchmark, in git
    history)."""
    if kv_total <= 0 or sampled_ms is None or now_ms - sampled_ms > max_age_ms:
        return None
    return kv_total - kv_used


def kv_need(samples: Iterable[tuple[int, int]]) -> int:
    """An average request's KV reservation, from (depth, kv_used) samples of a model's
    replicas: the tokens held per sequence over all of them (waiting sequences hold none, so
    this leans low); 1 token (any room at all) when nothing runs."""
    depth = used = 0
    for d, u in samples:
        depth += d
        used += u
    return max(1, used // depth) if depth else 1


def less_loaded_of_two(pool: Sequence[Candidate], rng: random.Random) -> Candidate:
    """Two at random, the shorter queue; on a tie the one with more free KV."""
    a, b = rng.sample(list(pool), 2)
    return a if _key(a) <= _key(b) else b


def _key(c: Candidate) -> tuple[int, int]:
    return c.load, -(c.kv_free or 0)
