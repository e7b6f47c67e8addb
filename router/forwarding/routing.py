"""Which replica takes a request: the router only decides here, it sends nothing.

`Picker.pick` builds the policy's candidates from the registry's replicas (each one's last
depth and KV sample, if fresh, and the router's own calls in flight to it), refuses when
every replica is at its max queue, and applies session affinity (affinity.py). The
policy itself is a pure function (policy.py). For policy "prefix" it also reads the
request's prompt (its bytes, as prefix_index.py parses them), scores each replica's
overlap from the index, and records the prompt's blocks as held by the replica it picked. A
replica seen with a new start time restarted empty, and one gone from the registry holds
nothing here any more: the entries of both go at the next pick (`live`, the registry's
replicas, tells; the pool a pick is given leaves out the ejected and the tried). A model
whose replicas publish no KV occupancy (not an LLM) is not read for a prompt: p2c decides.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from common.errors import ResourceExhausted
from common.mesh_state import now_ms
from router.forwarding import policy
from router.forwarding.affinity import Affinity
from router.forwarding.prefix_index import PrefixIndex, prompt_of, replica_key
from router.forwarding.replica import Replica
from router.telemetry import metrics


class Picker:
    def __init__(
        self,
        policy_name: str = "p2c",
        sample_max_age_ms: int = 1000,
        rng: random.Random | None = None,
        affinity: Affinity | None = None,
        index: PrefixIndex | None = None,
        prefix_weight: float = policy.PREFIX_WEIGHT,
    ) -> None:
        if policy_name not in policy.POLICIES:
            raise ValueError(f"unknown policy {policy_name!r}; choose one of {policy.POLICIES}")
        self.policy = policy_name
        self.sample_max_age_ms = sample_max_age_ms
        self.rng = rng or random.Random()
        self.affinity = affinity if affinity is not None else Affinity()
        self.index = index if index is not None else PrefixIndex()
        self.prefix_weight = prefix_weight
        self._started: dict[str, int] = {}  # replica id -> the start time its entries are of
        self._tick = 0

    def pick(
        self,
        replicas: list[Replica],
        model: str,
        session: str | None = None,
        raw: bytes | None = None,
        live: Mapping[str, Replica] | None = None,
    ) -> Replica:
        """One of `replicas` (of `model`) by the policy; the replica that served `session`
        before while it has room (see policy.choose, affinity); `raw`: the request's
        bytes (policy "prefix" reads its prompt); `live`: every replica the registry knows
        now, by id (default: `replicas`)."""
        now = now_ms()
        keys: list[bytes] = []
        if self.policy == "prefix" and raw is not None:
            self._notice_restarts(live if live is not None else {r.id: r for r in replicas})
            if any(r.sample is not None and r.sample.kv_total for r in replicas):
                found = prompt_of(raw)
                if found is not None:
                    keys = self.index.keys(model, *found)
        by_id = {r.id: r for r in replicas}
        fresh = [
            r.sample
            for r in replicas
            if r.sample is not None
            and r.sample.kv_total
            and now - r.sample.at_ms <= self.sample_max_age_ms
        ]
        need = policy.kv_need((s.depth, s.kv_used) for s in fresh)
        overlaps = self.index.overlaps(keys, [_key(r) for r in replicas]) if keys else {}
        candidates = [
            self._candidate(r, model, now, overlaps.get(_key(r), 0), len(keys)) for r in replicas
        ]
        open_ = [c for c in candidates if not c.full]
        if not open_:
            raise ResourceExhausted(
                f"every replica of model {model!r} is at its max queue "
                f"({', '.join(f'{c.id}: {c.load}/{c.max_queue}' for c in candidates)}); "
                "retry later"
            )
        self._tick += 1
        preferred = self.affinity.get(model, session)
        chosen = policy.choose(
            self.policy, open_, self.rng, self._tick, need, preferred, len(keys), self.prefix_weight
        )
        if self.policy == "prefix":
            self._prefix_picked(by_id[chosen.id], open_, chosen, keys)
        if session is not None:
            outcome = "new" if preferred is None else "hit" if chosen.id == preferred else "moved"
            metrics.AFFINITY.labels(outcome).inc()
            self.affinity.remember(model, session, chosen.id)
        if self.policy in ("p2c", "prefix") and not chosen.has_room(need):
            metrics.KV_NO_ROOM.inc()  # every replica's cache was full: it waits there
        return by_id[chosen.id]

    def _prefix_picked(
        self,
        replica: Replica,
        open_: list[policy.Candidate],
        chosen: policy.Candidate,
        keys: list[bytes],
    ) -> None:
        if keys:
            if any(c.decode_blocks is None for c in open_):
                metrics.PREFIX_FALLBACK.inc()
            metrics.PREFIX_BLOCKS.labels("total").inc(len(keys))
            metrics.PREFIX_BLOCKS.labels("matched").inc(min(chosen.overlap, len(keys)))
            self.index.record(keys, _key(replica))
            by_worker = dict.fromkeys(self._started, 0)
            for key, n in self.index.held().items():  # any instance of the id: a check
                worker = key.rsplit("@", 1)[0]
                by_worker[worker] = by_worker.get(worker, 0) + n
            for worker, n in by_worker.items():
                metrics.PREFIX_HELD.labels(worker).set(n)

    def _notice_restarts(self, live: Mapping[str, Replica]) -> None:
        """Forget the entries of replicas that restarted (a new start time) or left."""
        for worker, started in list(self._started.items()):
            r = live.get(worker)
            if r is None or r.info.started_ms != started:
                self.index.forget(replica_key(worker, started))
                del self._started[worker]
                metrics.PREFIX_HELD.remove(worker)
        for r in live.values():
            self._started.setdefault(r.id, r.info.started_ms)

    def _candidate(
        self, r: Replica, model: str, now: int, overlap: int = 0, blocks: int = 0
    ) -> policy.Candidate:
        sample = r.sample
        decode = None
        if sample is not None and sample.kv_total and now - sample.at_ms <= self.sample_max_age_ms:
            decode = sample.kv_used // policy.TOKENS_PER_BLOCK  # the calls since: in load
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
            overlap,
            decode,
        )


def _key(r: Replica) -> str:
    return replica_key(r.id, r.info.started_ms)
