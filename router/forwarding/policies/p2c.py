"""p2c: the less loaded of two replicas drawn at random, KV-aware. Replicas without room for
an average request's reservation are left out while any has room (a request sent there waits
however short the queue looks); equal queues go to the one with more free KV."""

from __future__ import annotations

from collections.abc import Sequence

from router.forwarding.policies.base import Ask, Candidate, Policy, less_loaded_of_two
from router.telemetry import metrics


class P2C(Policy):
    name = "p2c"

    def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        pool = [c for c in candidates if c.has_room(ask.need)] or list(candidates)
        if len(pool) == 1:
            return pool[0]
        return less_loaded_of_two(pool, self.rng)

    def picked(self, chosen: Candidate, candidates: Sequence[Candidate], ask: Ask) -> None:
        if not chosen.has_room(ask.need):
            metrics.KV_NO_ROOM.inc()  # every replica's cache was full: it waits there
