"""The event loop's lock-free metrics are exposed exactly as prometheus_client's own types
(no `_created` series): same names, labels, cumulative buckets, counts and sums."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.telemetry.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

BOUNDS = (0.0005, 0.001, 0.002, 5.0)


def exposition(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


def test_loop_metrics_read_as_prometheus_client_metrics() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("lat_seconds", "d", ["part"], buckets=BOUNDS, registry=theirs)
    c = Counter("req", "d", ["model", "code"], registry=theirs)
    g = Gauge("inflight", "d", ["worker"], registry=theirs)
    lh = LoopHistogram("lat_seconds", "d", ["part"], BOUNDS, registry=ours)
    lc = LoopCounter("req", "d", ["model", "code"], registry=ours)
    lg = LoopGauge("inflight", "d", ["worker"], registry=ours)
    # on a bound, between bounds, above every bound
    for value in (0.0001, 0.0005, 0.0007, 0.003, 7.0, 0.001):
        for part in ("router", "upstream"):
            h.labels(part).observe(value)
            lh.labels(part).observe(value)
    for labels in (("mlp", "OK"), ("mlp", "OK"), ("_unknown_", "NOT_FOUND")):
        c.labels(*labels).inc()
        lc.labels(*labels).inc()
    for worker in ("a", "b", "a"):
        g.labels(worker).inc()
        lg.labels(worker).inc()
    g.labels("a").dec()
    lg.labels("a").dec()
    assert exposition(ours) == exposition(theirs)
    assert 'lat_seconds_bucket{le="0.001",part="router"} 4.0' in exposition(ours)
