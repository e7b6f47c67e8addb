"""Prometheus metrics of the router (served on --metrics-port, 127.0.0.1 by default)."""

from __future__ import annotations

from prometheus_client import Counter

from common.llm_protocol import TOKEN_BUCKETS
from router.telemetry.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

# Updated once or more per request (or streamed piece): kept by the event loop without a
# lock (router/telemetry/loop_metrics.py). The rest are prometheus_client's own.

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

REQUESTS = LoopCounter(
    "meshserve_router_requests", "ModelInfer calls by model and status code", ["model", "code"]
)
LATENCY = LoopHistogram(
    "meshserve_router_latency_seconds",
    "ModelInfer latency: part=router is time spent in the router, part=upstream in the worker call",
    ["part"],
    buckets=BUCKETS,
)
RETRIES = Counter("meshserve_router_retries", "Calls retried on another replica", ["reason"])
MIGRATIONS = Counter(
    "meshserve_router_migrations",
    "Streams moved mid-way to another replica after theirs failed, resumed from the token ids "
    "their clients were sent (router/forwarding/migration.py)",
    ["model"],
)
EJECTIONS = Counter("meshserve_router_ejections", "Replicas ejected after a failure", ["worker"])
INFLIGHT = LoopGauge("meshserve_router_inflight", "Calls in flight from this router", ["worker"])
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
SHED = Counter(
    "meshserve_router_shed",
    "Calls refused before they started: the model's predicted queue wait was over the bound "
    "of the caller's priority (router/forwarding/shedding.py)",
    ["model", "priority"],
)
AFFINITY = Counter(
    "meshserve_router_affinity",
    "Picks of requests naming a session: outcome=hit (the replica that served it before), "
    "moved (that replica was full or gone: balanced elsewhere), new (a session not known)",
    ["outcome"],
)
KV_NO_ROOM = Counter(
    "meshserve_router_kv_no_room",
    "Picks (p2c, prefix) where no replica had KV room for an average request: it waits in a queue",
)
PREFIX_BLOCKS = Counter(
    "meshserve_router_prefix_blocks",
    "Prompt blocks of the requests routed by policy prefix: kind=total, or matched (held by "
    "the chosen replica, as this router's index believes)",
    ["kind"],
)
PREFIX_FALLBACK = Counter(
    "meshserve_router_prefix_fallback",
    "Picks of LLM prompts by policy prefix made by p2c: a candidate's load unknown (no fresh "
    "sample: Redis lost, or samples stale)",
)
PREFIX_HELD = LoopGauge(
    "meshserve_router_prefix_index_blocks",
    "Prompt blocks the router's prefix index believes the replica holds (policy prefix); "
    "dropped when the replica restarts or leaves",
    ["worker"],
)
# Per replica, from its last depth sample; a replica's series is removed when it leaves the
# registry, so the labels are the replicas the router knows now.
REPLICA_DEPTH = LoopGauge(
    "meshserve_router_replica_depth",
    "Requests waiting + running on the replica (an LLM engine: its sequences), last sample",
    ["worker"],
)
KV_USED = LoopGauge(
    "meshserve_router_replica_kv_used_tokens",
    "KV cache tokens the replica's running sequences hold, last sample (LLM replicas)",
    ["worker"],
)
KV_TOTAL = LoopGauge(
    "meshserve_router_replica_kv_total_tokens",
    "The replica's KV cache budget in tokens, last sample (LLM replicas)",
    ["worker"],
)
REPLICA_GAUGES = (REPLICA_DEPTH, KV_USED, KV_TOTAL)


def observe_sample(worker: str, depth: int, kv_used: int, kv_total: int) -> None:
    REPLICA_DEPTH.labels(worker).set(depth)
    if kv_total:
        KV_USED.labels(worker).set(kv_used)
        KV_TOTAL.labels(worker).set(kv_total)


def forget_replica(worker: str) -> None:
    for gauge in REPLICA_GAUGES:
        gauge.remove(worker)  # none if no sample was seen from it


# Token streams (ModelStreamInfer of an LLM), labelled by served model only.
TTFT = LoopHistogram(
    "meshserve_router_time_to_first_token_seconds",
    "From a streamed request's arrival at the router to its first piece of text from the worker",
    ["model"],
    buckets=TOKEN_BUCKETS,
)
INTER_TOKEN = LoopHistogram(
    "meshserve_router_inter_token_seconds",
    "Between pieces of a stream from the worker, per token they carry",
    ["model"],
    buckets=TOKEN_BUCKETS,
)
TOKENS = LoopCounter(
    "meshserve_router_tokens",
    "Tokens of streamed and unary LLM calls as the workers reported them: kind=in|out",
    ["model", "kind"],
)
