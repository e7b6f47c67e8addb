"""Which replica takes a request: the router only decides here, it sends nothing.

`Picker.pick` builds the policy's candidates from the registry's replicas (each one's last
depth and KV sample, if fresh, and the router's own calls in flight to it), refuses when
every replica is at its max queue, and hands them to the policy (policies/), with the
session's replica (affinity.py) as a preference. A policy that needs the prompt gets it read
from the request's bytes (as prefix_index.py parses them) and each replica's overlap scored
from the index. A replica seen with a new start time restarted empty, and one gone from the
registry holds nothing here any more: the entries of both go at the next such pick (`live`,
the registry's replicas, tells; the pool a pick is given leaves out the ejected and the
tried). A model whose replicas publish no KV occupancy (not an LLM) is not read for a prompt.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.errors import ResourceExhausted
from common.mesh_state import now_ms
from router.forwarding.affinity import Affinity
from router.forwarding.policies import TOKENS_PER_BLOCK, Ask, Candidate, Policy, kv_free, kv_need
from router.forwarding.policies import load as load_of
from router.forwarding.prefix_index import PrefixIndex, prompt_of, replica_key
from router.forwarding.replica import Replica
from router.telemetry import metrics


class Picker:
    def __init__(
        self,
        policy: Policy,
        sample_max_age_ms: int = 1000,
        affinity: Affinity | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        self.policy = policy
        self.sample_max_age_ms = sample_max_age_ms
        self.affinity = affinity if affinity is not None else Affinity()
        self.index = index if index is not None else PrefixIndex()  # the policy's, if it has one
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
        before while it has room (see Policy.choose, affinity); `raw`: the request's bytes
        (read for a policy that needs the prompt); `live`: every replica the registry knows
        now, by id (default: `replicas`)."""
        now = now_ms()
        keys: list[bytes] = []
        if self.policy.needs_prompt and raw is not None:
            keys = self._prompt_keys(replicas, model, raw, live)
        by_id = {r.id: r for r in replicas}
        fresh = [
            r.sample
            for r in replicas
            if r.sample is not None
            and r.sample.kv_total
            and now - r.sample.at_ms <= self.sample_max_age_ms
        ]
        need = kv_need((s.depth, s.kv_used) for s in fresh)
        overlaps = self.index.overlaps(keys, [_key(r) for r in replicas]) if keys else {}
        candidates = [self._candidate(r, model, now, overlaps.get(_key(r), 0)) for r in replicas]
        open_ = [c for c in candidates if not c.full]
        if not open_:
            raise ResourceExhausted(
                f"every replica of model {model!r} is at its max queue "
                f"({', '.join(f'{c.id}: {c.load}/{c.max_queue}' for c in candidates)}); "
                "retry later"
            )
        self._tick += 1
        preferred = self.affinity.get(model, session)
        ask = Ask(need, preferred, len(keys), self._tick, tuple(keys))
        chosen = self.policy.choose(open_, ask)
        self.policy.picked(chosen, open_, ask)
        if session is not None:
            outcome = "new" if preferred is None else "hit" if chosen.id == preferred else "moved"
            metrics.AFFINITY.labels(outcome).inc()
            self.affinity.remember(model, session, chosen.id)
        return by_id[chosen.id]

    def _prompt_keys(
        self,
        replicas: list[Replica],
        model: str,
        raw: bytes,
        live: Mapping[str, Replica] | None,
    ) -> list[bytes]:
        """The prompt's block keys, after the index forgot replicas that restarted or left;
        none for a model whose replicas report no KV cache, or a request with no prompt."""
        seen = live if live is not None else {r.id: r for r in replicas}
        for worker in self.index.notice({r.id: r.info.started_ms for r in seen.values()}):
            metrics.PREFIX_HELD.remove(worker)
        if not any(r.sample is not None and r.sample.kv_total for r in replicas):
            return []
        found = prompt_of(raw)
        return self.index.keys(model, *found) if found is not None else []

    def _candidate(self, r: Replica, model: str, now: int, overlap: int = 0) -> Candidate:
        sample = r.sample
        decode = None
        if sample is not None and sample.kv_total and now - sample.at_ms <= self.sample_max_age_ms:
            decode = sample.kv_used // TOKENS_PER_BLOCK  # the calls since: in load
        return Candidate(
            r.id,
            load_of(
                sample.depth if sample else None,
                sample.at_ms if sample else None,
                r.inflight.values(),
                now,
                self.sample_max_age_ms,
            ),
            r.info.models[model].max_queue,
            kv_free(sample.kv_used, sample.kv_total, sample.at_ms, now, self.sample_max_age_ms)
            if sample
            else None,
            overlap,
            decode,
            _key(r),
        )


def _key(r: Replica) -> str:
    return replica_key(r.id, r.info.started_ms)
