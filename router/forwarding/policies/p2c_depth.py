"""p2c_depth: plain power of two choices on queue depth, blind to the KV cache (kept to
compare with the KV-aware p2c)."""

from __future__ import annotations

from collections.abc import Sequence

from router.forwarding.policies.base import Ask, Candidate, Policy


class P2CDepth(Policy):
    name = "p2c_depth"

    def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
        a, b = self.rng.sample(list(candidates), 2)
        return a if a.load <= b.load else b
