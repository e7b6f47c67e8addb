"""The queueing model the planner predicts with: M/D/c with batching.

Calls arrive as a Poisson stream at rate lam (M), spread evenly over c replicas. A replica
runs one batch at a time; a batch of b costs the deterministic time S(b) (D) from the
Roofline. Its dynamic batcher takes everything waiting, up to max_batch, so under load the
batch settles where the calls that arrive during one run fill the next:
b = lam / c x S(b) (solved by fixed point, clipped to 1..max_batch). A replica then serves
mu = b / S(b) calls/s; the mesh saturates at c x max_batch / S(max_batch).

Latency of a call = the run it rides in, S(b), plus its wait: the run in progress when it
arrived (busy with probability u, uniform over 0..S(b): its 99th percentile is
S(b) (1 - 0.01 / u)), or, near saturation where calls wait more than one run, M/D/c's queue
by the Allen-Cunneen approximation W(M/D/c) ~ W(M/M/c) x (1 + 0) / 2, whose tail is Erlang
C's exponential, P(W > t) = C(c, a) exp(-(c mu - lam) t); the larger of the two. And the
mesh's own latency (router, gRPC).

When the replicas share one host's cores (this machine in the benchmark), every call also
costs host CPU: the mesh's CPU per call plus the batch's compute threads x S(b) / b; the
host saturates at cores / that. The mesh itself (one router process) tops out at the rate
the probe measured. The capacity is the lowest of these limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Prediction:
    capacity_rps: float  # the most calls/s the configuration serves
    throughput_rps: float  # min(offered, capacity)
    batch: float  # the batch size under the offered load
    utilisation: float  # offered / capacity at that batch (>= 1: unstable)
    p50_s: float
    p99_s: float
    limit: str  # what caps the capacity: the replicas, the host's cores or the mesh


def erlang_c(c: int, a: float) -> float:
    """Probability an arrival waits in M/M/c with offered load a = lam / mu (a < c)."""
    if a <= 0:
        return 0.0
    term, total = 1.0, 1.0
    for k in range(1, c):
        term *= a / k
        total += term
    last = term * a / c / (1 - a / c)
    return last / (total + last)


def settle_batch(per_replica_rps: float, service: Callable[[int], float], max_batch: int) -> int:
    b = 1
    for _ in range(50):
        nxt = min(max_batch, max(1, math.ceil(per_replica_rps * service(b))))
        if nxt == b:
            break
        b = nxt
    return b


def predict(
    offered_rps: float,
    replicas: int,
    max_batch: int,
    service: Callable[[int], float],
    mesh_latency_s: float = 0.0,
    host_cores: float | None = None,
    cpu_per_call_s: float = 0.0,
    threads_per_replica: int = 1,
    mesh_max_rps: float = 0.0,
) -> Prediction:
    """`service(b)`: seconds one replica takes for a batch of b. With `host_cores`, the
    replicas share that many cores with the mesh's own work (`cpu_per_call_s` per call)."""
    top = service(max_batch)
    limits = {"replicas": replicas * max_batch / top}
    if host_cores:
        limits["host cores"] = host_cores / (cpu_per_call_s + threads_per_replica * top / max_batch)
    if mesh_max_rps:
        limits["the mesh (router)"] = mesh_max_rps
    limit = min(limits, key=lambda k: limits[k])
    capacity = limits[limit]
    b = settle_batch(offered_rps / replicas, service, max_batch)
    s = service(b)
    if host_cores:
        # Replicas whose threads outnumber the cores stretch each other's runs while busy.
        share = replicas * threads_per_replica / host_cores
        s *= max(1.0, 1 + (share - 1) * min(1.0, offered_rps / capacity))
    mu = b / s
    rho = offered_rps / (replicas * mu)
    util = max(rho, offered_rps / capacity)
    if util >= 1:
        return Prediction(capacity, capacity, b, util, math.inf, math.inf, limit)
    c_wait = erlang_c(replicas, offered_rps / mu)
    gap = replicas * mu - offered_rps
    q99 = 0.5 * math.log(c_wait / 0.01) / gap if c_wait > 0.01 else 0.0
    q50 = 0.5 * math.log(c_wait / 0.5) / gap if c_wait > 0.5 else 0.0
    # A call that finds its replica busy (probability util) waits out the run in progress,
    # uniform over 0..s, and rides the next batch; beyond that only the M/D/c queue tail.
    residual99 = s * max(0.0, 1 - 0.01 / util) if util > 0 else 0.0
    p99 = mesh_latency_s + s + max(residual99, q99)
    p50 = mesh_latency_s + s + s * util / 2 + q50
    return Prediction(capacity, offered_rps, b, util, p50, p99, limit)
