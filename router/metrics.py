"""Prometheus metrics of the router (served on --metrics-port, 127.0.0.1 by default)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

REQUESTS = Counter(
    "meshserve_router_requests", "ModelInfer calls by model and status code", ["model", "code"]
)
LATENCY = Histogram(
    "meshserve_router_latency_seconds",
    "ModelInfer latency: part=router is time spent in the router, part=upstream in the worker call",
    ["part"],
    buckets=BUCKETS,
)
RETRIES = Counter("meshserve_router_retries", "Calls retried on another replica", ["reason"])
EJECTIONS = Counter("meshserve_router_ejections", "Replicas ejected after a failure", ["worker"])
INFLIGHT = Gauge("meshserve_router_inflight", "Calls in flight from this router", ["worker"])
REPLIES_BEFORE_DURABLE = Counter(
    "meshserve_router_replies_before_durable",
    "Successes answered before their record was in Redis (Redis slow or down)",
)
REFUNDS = Counter(
    "meshserve_router_refunds",
    "Calls recorded as a success whose client did not get the reply, then counted as errors",
)
REJECTED = Counter(
    "meshserve_router_admission_rejected",
    "Calls answered RESOURCE_EXHAUSTED at once: the router's in-flight limit was reached",
    ["scope"],
)
