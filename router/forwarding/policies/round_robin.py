"""round_robin: each replica in turn, in id order (the pick count decides, not a clock)."""

from __future__ import annotations

from collections.abc import Sequence

from router.forwarding.policies.base import Ask, Candidate, Policy


class RoundRobin(Policy):
    name = "round_robin"

    def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        return sorted(candidates, key=lambda c: c.id)[ask.tick % len(candidates)]
