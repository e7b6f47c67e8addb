"""random: any replica, load ignored (the baseline the others are measured against)."""

from __future__ import annotations

from collections.abc import Sequence

from router.forwarding.policies.base import Ask, Candidate, Policy


class Uniform(Policy):
    name = "random"

    def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        return self.rng.choice(list(candidates))
