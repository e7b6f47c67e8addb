"""least_loaded: the shortest queue, ties at random. Every router herds onto the same replica
between samples; p2c does not."""

from __future__ import annotations

from collections.abc import Sequence

from router.forwarding.policies.base import Ask, Candidate, Policy


class LeastLoaded(Policy):
    name = "least_loaded"

    def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        least = min(c.load for c in candidates)
        return self.rng.choice([c for c in candidates if c.load == least])
