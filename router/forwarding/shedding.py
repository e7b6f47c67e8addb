"""Admission with a prediction: a request whose predicted queue wait is over its bound is
refused before it starts, with when to come back.

The prediction, per model, is over the replicas serving it that publish a service rate with
their depth (common/mesh_state.DepthSample: `slots` run at once, `rate_milli` requests
finished per 1,000 s, measured by the worker: worker/llm/service_time.py). Each replica's
queue is its depth, plus this router's calls to it that its sample did not count yet (sent
after it was taken), less its slots; the router's calls admitted but not sent yet fill the
free slots first. A request that finds a slot free waits 0; otherwise its wait is its place
in the pooled queue (the router balances the replicas' queues): it starts after k slot
releases, k = queued + pending - free + 1, which come at the pooled rate mu. The bound is
held against the wait's 99th percentile, not its mean (a request at the edge of a mean
bound waits past it half the time): k releases at rate mu, each about exponential, take
Gamma(k, mu), whose 99th percentile is about (k + 2.33 sqrt(k)) / mu (its normal
approximation). So a burst between two samples is not all admitted on one. A wait unknown
(no replica publishes a rate yet: nothing finished) admits the request.

The bound is the router's `--queue-wait-bound-seconds` (0: off), scaled by the tenant's
priority (common/tenancy.PRIORITIES: high x2, normal x1, low x0.5): lower classes are shed
first, at lower predicted waits. A shed request gets RESOURCE_EXHAUSTED (HTTP 429) with
`retry-after` (seconds, the trailing metadata; HTTP's Retry-After header): the time the
queue takes, with no new arrivals, to drain to the place whose wait is within the bound. Only a
request that has not started is shed; nothing running or queued on a worker is cancelled.
The router records it as an error with no revenue, counted `shed` (mesh_state.SHED_FIELDS).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from common.errors import ResourceExhausted, clip
from common.mesh_state import now_ms
from common.tenancy import PRIORITIES
from router.forwarding.replica import Replica
from router.telemetry import metrics

Z99 = 2.33  # the standard normal's 99th percentile


@dataclass(frozen=True)
class Line:
    """Where a new request stands: `place` slot releases before it starts (0: a slot is
    free), at `rate` releases per second."""

    place: int
    rate: float

    def wait(self, place: int | None = None) -> float:
        """The 99th percentile of the wait at `place` (default: the new request's)."""
        k = self.place if place is None else place
        return 0.0 if k <= 0 else (k + Z99 * math.sqrt(k)) / self.rate

    def retry_after(self, bound: float) -> float:
        """Seconds until the line drains to a place whose wait is within `bound`."""
        root = (-Z99 + math.sqrt(Z99 * Z99 + 4 * bound * self.rate)) / 2
        within = math.floor(root * root)  # the last place within the bound
        while within > 0 and self.wait(within) > bound:
            within -= 1
        return max(self.place - within, 1) / self.rate


def predicted_wait(
    replicas: Iterable[Replica], inflight: int, now: int, max_age_ms: int
) -> Line | None:
    """A request of the model arriving now: its place in line and the rate it moves at;
    None: unknown. `inflight`: this router's calls to the model in flight (admitted, maybe
    not sent)."""
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
    place = 0 if pending < free else ahead + pending - free + 1
    return Line(place, rate / 1000)


class Shedder:
    def __init__(self, bound_s: float, sample_max_age_ms: int = 1000) -> None:
        self.bound_s = bound_s
        self.sample_max_age_ms = sample_max_age_ms

    def bound(self, priority: str) -> float:
        return self.bound_s * PRIORITIES[priority]

    def check(self, model: str, priority: str, replicas: Iterable[Replica], inflight: int) -> None:
        """ResourceExhausted (with retry-after) when the model's predicted wait is over the
        bound of `priority`; counted in the metrics."""
        line = predicted_wait(replicas, inflight, now_ms(), self.sample_max_age_ms)
        bound = self.bound(priority)
        if line is None or line.wait() <= bound:
            return
        metrics.SHED.labels(model, priority).inc()
        wait, retry = line.wait(), line.retry_after(bound)
        raise ResourceExhausted(
            f"model {clip(model)} is overloaded: a new request would wait up to {wait:.2f} s "
            f"(p99) for a slot, over the {bound:g} s bound of {priority}-priority calls; retry in "
            f"{retry:.2f} s (retry-after in the trailing metadata; on a stream, in the error "
            "response's parameters)",
            trailers=(("retry-after", f"{retry:.3f}"), ("limit", "queue_wait")),
        )
