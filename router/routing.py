"""Which replica takes a request: the router only decides here, it sends nothing.

`Picker.pick` builds the policy's candidates from the registry's replicas (each one's last
depth and KV sample, if fresh, and the router's own calls in flight to it), refuses when
every replica is at its max queue, and applies session affinity (router/affinity.py). The
policy itself is a pure function (router/policy.py).
"""

from __future__ import annotations

import random

from common.errors import ResourceExhausted
from common.mesh_state import now_ms
from router import metrics, policy
from router.affinity import Affinity
from router.registry import Replica


class Picker:
    def __init__(
        self,
        policy_name: str = "p2c",
        sample_max_age_ms: int = 1000,
        rng: random.Random | None = None,
        affinity: Affinity | None = None,
    ) -> None:
        if policy_name not in policy.POLICIES:
            raise ValueError(f"unknown policy {policy_name!r}; choose one of {policy.POLICIES}")
        self.policy = policy_name
        self.sample_max_age_ms = sample_max_age_ms
        self.rng = rng or random.Random()
        self.affinity = affinity if affinity is not None else Affinity()
        self._tick = 0

    def pick(self, replicas: list[Replica], model: str, session: str | None = None) -> Replica:
        """One of `replicas` (of `model`) by the policy; the replica that served `session`
        before while it has room (see policy.choose, router.affinity)."""
        now = now_ms()
        by_id = {r.id: r for r in replicas}
        fresh = [
            r.sample
            for r in replicas
            if r.sample is not None
            and r.sample.kv_total
            and now - r.sample.at_ms <= self.sample_max_age_ms
        ]
        need = policy.kv_need((s.depth, s.kv_used) for s in fresh)
        candidates = [self._candidate(r, model, now) for r in replicas]
        open_ = [c for c in candidates if not c.full]
        if not open_:
            raise ResourceExhausted(
                f"every replica of model {model!r} is at its max queue "
                f"({', '.join(f'{c.id}: {c.load}/{c.max_queue}' for c in candidates)}); "
                "retry later"
            )
        self._tick += 1
        preferred = self.affinity.get(model, session)
        chosen = policy.choose(self.policy, open_, self.rng, self._tick, need, preferred)
        if session is not None:
            outcome = "new" if preferred is None else "hit" if chosen.id == preferred else "moved"
            metrics.AFFINITY.labels(outcome).inc()
            self.affinity.remember(model, session, chosen.id)
        if self.policy == "p2c" and not chosen.has_room(need):
            metrics.KV_NO_ROOM.inc()  # every replica's cache was full: it waits there
        return by_id[chosen.id]

    def _candidate(self, r: Replica, model: str, now: int) -> policy.Candidate:
        sample = r.sample
        return policy.Candidate(
            r.id,
            policy.load(
                sample.depth if sample else None,
                sample.at_ms if sample else None,
                r.inflight.values(),
                now,
                self.sample_max_age_ms,
            ),
            r.info.models[model].max_queue,
            policy.kv_free(
                sample.kv_used, sample.kv_total, sample.at_ms, now, self.sample_max_age_ms
            )
            if sample
            else None,
        )
