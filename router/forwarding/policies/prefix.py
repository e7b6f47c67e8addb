"""prefix (cache-aware, for LLM replicas): one cost per replica, as NVIDIA Dynamo's KV router
scores them: `weight x uncached prompt blocks + decode blocks + load x prompt blocks`, the
prompt blocks the replica does not hold yet (router/forwarding/prefix_index.py's estimate),
the KV blocks its running sequences hold (its KV sample in blocks), and its requests (`load`:
waiting and running, with this router's calls since the sample) at the request's own size:
a waiting sequence holds no KV yet, and a replica with a deep queue is far busier whatever
its KV says. The lowest cost wins, ties by p2c. A replica without KV room is out first, as
for p2c, and a busy replica's load outweighs its cache: a hot prefix spreads over replicas
once one holds more than `weight x` the prefix's blocks of KV more, or about `weight`
requests more, than another. A session's replica is scored as holding the whole prompt
(affinity, the same cost). Where a candidate's load is unknown (no fresh sample: Redis lost,
or not an LLM), it is p2c.

When it picks it records the prompt's blocks as held by the chosen replica in the index.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.forwarding.policies.base import Ask, Candidate, Policy, Setup, less_loaded_of_two
from router.forwarding.policies.p2c import P2C
from router.telemetry import metrics


class Prefix(Policy):
    name = "prefix"
    needs_prompt = True

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.index = setup.index
        self.weight = setup.prefix_weight
        self.fallback = P2C(setup)

    def choose(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        if all(c.decode_blocks is not None for c in candidates):
            return self.select(candidates, ask)
        return self.fallback.choose(candidates, ask)  # a load unknown: nothing to weigh

    def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        pool = [c for c in candidates if c.has_room(ask.need)] or list(candidates)
        costs = [cost(c, ask.blocks, self.weight, ask.preferred) for c in pool]
        low = min(costs)
        tied = [c for c, x in zip(pool, costs, strict=True) if x == low]
        if len(tied) == 1:
            return tied[0]
        return less_loaded_of_two(tied, self.rng)

    def picked(self, chosen: Candidate, candidates: Sequence[Candidate], ask: Ask) -> None:
        if ask.keys:
            if any(c.decode_blocks is None for c in candidates):
                metrics.PREFIX_FALLBACK.inc()
            metrics.PREFIX_BLOCKS.labels("total").inc(len(ask.keys))
            metrics.PREFIX_BLOCKS.labels("matched").inc(min(chosen.overlap, len(ask.keys)))
            self.index.record(ask.keys, chosen.key)
            for worker, n in self.index.held_by_worker().items():
                metrics.PREFIX_HELD.labels(worker).set(n)
        self.fallback.picked(chosen, candidates, ask)


def cost(c: Candidate, blocks: int, weight: float, preferred: str | None = None) -> float:
    """weight x the prompt blocks to prefill + the KV blocks held + one prompt's blocks per
    request the replica has (waiting sequences hold no KV yet, but each will take a turn)."""
    held = blocks if c.id == preferred else min(c.overlap, blocks)
    return weight * (blocks - held) + (c.decode_blocks or 0) + c.load * max(blocks, 1)
