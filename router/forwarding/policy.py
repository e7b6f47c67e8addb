"""Balancing policies: pure functions of (candidates, rng, tick). No clock, no network.

`load` turns what the router knows about a replica into one number: the queue depth the
worker last published, plus the calls this router sent it after that sample was taken (the
sample cannot include them yet), and never less than this router's own calls in flight to
it: samples arrive within a millisecond now (pushed), and a sample that fresh does not show
the calls still on their way to the worker either. A sample older than `max_age_ms` counts
as unknown and only the router's own in-flight calls remain: acting on stale least-loaded
data makes every router herd onto the same replica (Mitzenmacher, "How useful is old information?").

KV cache (replicas serving an LLM engine publish the KV tokens their running sequences hold
and their budget): `kv_free` is the budget left as last sampled. An engine admits a
sequence only once its whole reservation (prompt + max_tokens) fits; a request sent to a
replica without room waits there, however short its queue looks. So "p2c" first keeps the
replicas with room for `need` tokens (an average request's reservation, see `kv_need`) when
any has room, then takes the less loaded of two, the one with more free KV on a tie.
"p2c_depth" is the plain, KV-blind p2c, kept to compare.

Affinity: `preferred` (the replica that served the request's session before) is taken as
long as it is a candidate with room; otherwise the policy decides as if there were none.

"prefix" (cache-aware, for LLM replicas): one cost per replica, as NVIDIA Dynamo's KV router
scores them: `weight x uncached prompt blocks + decode blocks + load x prompt blocks`, the
prompt blocks the replica does not hold yet (router/forwarding/prefix_index.py's estimate), the KV
blocks its running sequences hold (its KV sample in blocks), and its requests (`load`:
waiting and running, with this router's calls since the sample) at the request's own size:
a waiting sequence holds no KV yet, and a replica with a deep queue is far busier whatever
its KV says. The lowest cost wins, ties by p2c. A replica full or without KV room is out
first, as for p2c, and a busy replica's load outweighs its cache: a hot prefix spreads over
replicas once one holds more than `weight x` the prefix's blocks of KV more, or about
`weight` requests more, than another. A
session's replica is scored as holding the whole prompt (affinity, the same cost). Where a
candidate's load is unknown (no fresh sample: Redis lost, or not an LLM), it is p2c.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "p2c", "p2c_depth", "least_loaded", "round_robin", "random")
PREFIX_WEIGHT = 4.0  # a prefilled block costs this many held (decoding) blocks
TOKENS_PER_BLOCK = 16  # a KV sample's tokens -> blocks (a router block is ~16 tokens)


@dataclass(frozen=True)
class Candidate:
    id: str
    load: int
    max_queue: int
    kv_free: int | None = None  # KV tokens free; None: not an LLM replica, or unknown
    overlap: int = 0  # prompt blocks the replica holds (policy "prefix")
    decode_blocks: int | None = None  # KV blocks its sequences hold; None: unknown

    @property
    def full(self) -> bool:
        return self.load >= self.max_queue

    def has_room(self, need: int) -> bool:
        return self.kv_free is None or self.kv_free >= need


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
    one call, sending a burst to the full one (measured: benchmarks/kv_balance.py)."""
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


def choose(
    policy: str,
    candidates: Sequence[Candidate],
    rng: random.Random,
    tick: int,
    need: int = 1,
    preferred: str | None = None,
    blocks: int = 0,
    weight: float = PREFIX_WEIGHT,
) -> Candidate:
    """Pick one of `candidates` (non-empty, none full); `blocks`: the prompt's, for
    "prefix"."""
    if policy == "prefix" and all(c.decode_blocks is not None for c in candidates):
        return _cheapest(candidates, rng, need, preferred, blocks, weight)
    if policy == "prefix":
        policy = "p2c"  # a load unknown: nothing to weigh the cache against
    if preferred is not None:
        for c in candidates:
            if c.id == preferred and c.has_room(need):
                return c
    if len(candidates) == 1:
        return candidates[0]
    if policy == "p2c":
        roomy = [c for c in candidates if c.has_room(need)]
        pool = roomy if roomy else list(candidates)
        if len(pool) == 1:
            return pool[0]
        a, b = rng.sample(pool, 2)
        return a if _key(a) <= _key(b) else b
    if policy == "p2c_depth":
        a, b = rng.sample(list(candidates), 2)
        return a if a.load <= b.load else b
    if policy == "least_loaded":
        least = min(c.load for c in candidates)
        return rng.choice([c for c in candidates if c.load == least])
    if policy == "round_robin":
        return sorted(candidates, key=lambda c: c.id)[tick % len(candidates)]
    if policy == "random":
        return rng.choice(list(candidates))
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")


def cost(c: Candidate, blocks: int, weight: float, preferred: str | None = None) -> float:
    """weight x the prompt blocks to prefill + the KV blocks held + one prompt's blocks per
    request the replica has (waiting sequences hold no KV yet, but each will take a turn)."""
    held = blocks if c.id == preferred else min(c.overlap, blocks)
    return weight * (blocks - held) + (c.decode_blocks or 0) + c.load * max(blocks, 1)


def _cheapest(
    candidates: Sequence[Candidate],
    rng: random.Random,
    need: int,
    preferred: str | None,
    blocks: int,
    weight: float,
) -> Candidate:
    pool = [c for c in candidates if c.has_room(need)] or list(candidates)
    costs = [cost(c, blocks, weight, preferred) for c in pool]
    low = min(costs)
    tied = [c for c, x in zip(pool, costs, strict=True) if x == low]
    if len(tied) == 1:
        return tied[0]
    a, b = rng.sample(tied, 2)
    return a if _key(a) <= _key(b) else b


def _key(c: Candidate) -> tuple[int, int]:
    return c.load, -(c.kv_free or 0)
