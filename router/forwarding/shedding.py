"""Admission with a prediction: a request whose predicted queue wait is over its bound is
refused before it starts, with when to come back.

The prediction, per model, is over the replicas serving it that publish a service rate with
their depth (common/mesh_state.DepthSample: `slots` run at once, `rate_milli` requests
finished per 1,000 s, measured by the worker: worker/llm/service_time.py). Each replica's
queue is its depth, plus this router's calls to it that its sample did not count yet (sent
after it was taken), less its slots; the router's calls admitted but not sent yet fill the
free slots first. A request that finds a slot free waits 0; otherwise its wait is its place
in the pooled queue over the pooled rate (the router balances the replicas' queues):

    wait = (queued + pending - free + 1) / sum(rate)

so a burst between two samples is not all admitted on one. A wait unknown (no replica
publishes a rate yet: nothing finished) admits the request.

The bound is the router's `--queue-wait-bound-seconds` (0: off), scaled by the tenant's
priority (common/tenancy.PRIORITIES: high x2, normal x1, low x0.5): lower classes are shed
first, at lower predicted waits. A shed request gets RESOURCE_EXHAUSTED (HTTP 429) with
`retry-after` (seconds, the trailing metadata; HTTP's Retry-After header): the predicted
wait beyond its bound, the time the queue takes to drain to it with no new arrivals. Only a
request that has not started is shed; nothing running or queued on a worker is cancelled.
The router records it as an error with no revenue, counted `shed` (mesh_state.SHED_FIELDS).
"""

from __future__ import annotations

from collections.abc import Iterable

from common.errors import ResourceExhausted, clip
from common.mesh_state import now_ms
from common.tenancy import PRIORITIES
from router.forwarding.replica import Replica
from router.telemetry import metrics


def predicted_wait(
    replicas: Iterable[Replica], inflight: int, now: int, max_age_ms: int
) -> float | None:
    """Seconds a request of the model arriving now waits for a slot; None: unknown.
    `inflight`: this router's calls to the model in flight (admitted, maybe not sent)."""
    ahead = free = rate = sent = 0
    for r in replicas:
        s = r.sample
        if r.ejected or r.dropped or s is None or not s.slots or not s.rate_milli:
            continue
        if now - s.at_ms > max_age_ms:
            continue
        unseen = sum(1 for started in r.inflight.values() if started > s.at_ms)
        queue = s.depth + unseen - s.slots
        ahead, free = ahead + max(0, queue), free + max(0, -queue)
        rate, sent = rate + s.rate_milli, sent + len(r.inflight)
    if not rate:
        return None
    pending = max(0, inflight - sent)  # admitted here, not sent to a replica yet
    if pending < free:
        return 0.0
    return (ahead + pending - free + 1) * 1000 / rate


class Shedder:
    def __init__(self, bound_s: float, sample_max_age_ms: int = 1000) -> None:
        self.bound_s = bound_s
        self.sample_max_age_ms = sample_max_age_ms

    def bound(self, priority: str) -> float:
        return self.bound_s * PRIORITIES[priority]

    def check(self, model: str, priority: str, replicas: Iterable[Replica], inflight: int) -> None:
        """ResourceExhausted (with retry-after) when the model's predicted wait is over the
        bound of `priority`; counted in the metrics."""
        wait = predicted_wait(replicas, inflight, now_ms(), self.sample_max_age_ms)
        bound = self.bound(priority)
        if wait is None or wait <= bound:
            return
        metrics.SHED.labels(model, priority).inc()
        retry = max(wait - bound, 0.001)
        raise ResourceExhausted(
            f"model {clip(model)} is overloaded: a new request would wait about {wait:.2f} s "
            f"for a slot, over the {bound:g} s bound of {priority}-priority calls; retry in "
            f"{retry:.2f} s (retry-after in the trailing metadata; on a stream, in the error "
            "response's parameters)",
            trailers=(("retry-after", f"{retry:.3f}"), ("limit", "queue_wait")),
        )
