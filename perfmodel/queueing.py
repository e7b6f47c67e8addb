"""The queueing model the planner predicts with: M/D/c with batching.

Calls arrive as a Poisson stream at rate lam (M), spread evenly over c replicas. A replica
runs one batch at a time; a batch of b costs the deterministic time S(b) (D) from the
Roofline. Its dynamic batcher takes everything waiting, up to max_batch, so under load the
batch settles where the calls that arrive during one run fill the next:
b = lam / c x S(b) (solved by fixed point, clipped to 1..max_batch). A replica then serves
mu = b / S(b) calls/s.

Capacity is the saturation throughput: what a closed loop with enough callers gets, with
every replica's queue full, so running max_batch. Alone on their devices the replicas
saturate at c x max_batch / S(max_batch). When they share one host's cores with the mesh
(this machine in the benchmark: client, router, Redis and the workers on 2 cores) and with
other jobs, the mesh gets the cores the other jobs leave (the probe measures their demand),
and every call costs host CPU: the mesh's CPU per call (probed) plus threads x S(b) / b for
its share of a run; the host tops out at free cores / that. The mesh's serial path (one
router, one client loop) tops out at the rate the probe measured. And while more threads want
the free cores than there are (every replica's, plus the mesh's demand at that rate), each
run stretches by that ratio, which lowers the replicas' rate. The capacity is the lowest.

Latency of a call = the run it rides in, S(b), plus its wait: the run in progress when it
arrived (busy with probability u, uniform over 0..S(b): its 99th percentile is
S(b) (1 - 0.01 / u)), or, near saturation where calls wait more than one run, M/D/c's queue
at the batcher's top rate (max_batch / S(max_batch) per replica: a queue makes the batches
grow): a call waits with Erlang C's probability C(c, a), and the wait's tail falls as
exp(-theta t), theta M/D/c's own decay rate (md_c_decay; M/M/c's c mu - lam would make a
deterministic service's tail twice too long near saturation); the larger of the two. And the
mesh's own trip (client, router, gRPC): its median for the p50, its probed 99th percentile
for the p99 (the sum of two 99th percentiles: an upper bound on the sum's). On a shared host
below saturation, a run also waits for the free cores, which every call's CPU work (the
mesh's per call, its share of a run) reaches at random: its mean slowdown is M/M/n's
1 + C(n, a) / (n - a), a the cores' offered load lam x (CPU per call + threads x S(b) / b),
plus the fixed CPU a Poisson stream costs the client and mesh (probed in an open loop).
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
    saturation_batch: int = 0  # the batch the replicas run at capacity


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


def md_c_decay(lam: float, c: int, d: float) -> float:
    """The rate at which M/D/c's waiting-time tail falls, P(W > t) ~ C e^(-theta t): the
    root of c ln(1 + theta / lam) = theta d. Counted every d seconds the queue loses c calls
    and gains Poisson(lam d), so its length's tail falls as z^-n where z^c = e^(lam d (z - 1)),
    and a call n places back waits n d / c. (M/D/1: lam (e^(theta d) - 1) = theta, the
    classical result. M/M/c's tail falls at c mu - lam; a deterministic service's, about
    twice as fast near saturation and faster still below it.) Needs lam d < c."""

    if lam <= 0:
        return math.inf
    if lam * d >= c:
        return 0.0  # unstable: the queue grows without bound

    def f(theta: float) -> float:
        return c * math.log1p(theta / lam) - theta * d

    lo, hi = 0.0, (c / d - lam) or 1.0
    while f(hi) > 0:  # past the root: f falls from its peak to -inf
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def wait_quantile(c_wait: float, theta: float, p: float) -> float:
    """The wait exceeded with probability p, when a call waits with probability c_wait and
    the wait's tail falls at theta."""
    if c_wait <= p:
        return 0.0
    return math.log(c_wait / p) / theta if theta > 0 else math.inf


def poisson_quantile(mean: float, p: float) -> int:
    """The smallest n with P(N <= n) >= p, N ~ Poisson(mean)."""
    term = total = math.exp(-mean)
    n = 0
    while total < p and n < 10_000:
        n += 1
        term *= mean / n
        total += term
    return n


def between(service: Callable[[int], float], b: float) -> float:
    """service(b) for a mean batch b between whole batches: linear between them."""
    lo = math.floor(b)
    if lo == b:
        return service(lo)
    return service(lo) + (service(lo + 1) - service(lo)) * (b - lo)


def settle_batch(per_replica_rps: float, service: Callable[[int], float], max_batch: int) -> float:
    """The mean batch a replica's batcher forms: a run takes whatever arrived during the
    previous one, Poisson(lam S), or, when nothing did, starts with the next arrival alone,
    so E[b] = lam S(b) + e^(-lam S(b)) (the fixed point, damped; clipped to 1..max_batch).
    MiniLM int8 at 380 calls/s on one replica (S(1) = 2.4 ms): 1.4, where lam S(1) = 0.9
    would say 1; the worker formed 1.8."""
    b = 1.0
    for _ in range(100):
        s = between(service, b)
        if not math.isfinite(s):
            return float(max_batch)
        load = per_replica_rps * s
        nxt = min(float(max_batch), max(1.0, load + math.exp(-load)))
        if abs(nxt - b) < 1e-4:
            break
        b = (b + nxt) / 2
    return b


def _host_slowdown(demand: float, free: float) -> float:
    """Mean slowdown of CPU work offered at `demand` cores to `free` cores (M/M/n)."""
    n = max(1, round(free))
    if demand >= n:
        return math.inf
    return 1 + erlang_c(n, demand) / (n - demand)


def _stretch(wanting: float, free: float) -> float:
    """How much longer a run takes while `wanting` threads share `free` cores."""
    return max(1.0, wanting / free)


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
    background_cores: float = 0.0,
    mesh_latency_p99_s: float = 0.0,
    open_cpu: tuple[float, float] | None = None,
    continuous: bool = False,
    contended: bool = False,
) -> Prediction:
    """`service(b)`: seconds one replica takes for a batch of b, alone on its cores.
    `continuous`: the replica batches at every step (the LLM engine), not per run. With
    `host_cores`, the replicas share that many cores with the mesh's own work
    (`cpu_per_call_s` per call at saturation; `open_cpu`: (fixed cores, seconds per call)
    under Poisson arrivals, when probed) and with other jobs (`background_cores`).
    `contended`: service(b) was measured on this shared host, under load (planner/serving.py),
    so it already holds the wait for a core: no further slowdown below saturation."""
    t = threads_per_replica
    # Other jobs keep the CPU they were using; the mesh and its replicas get the rest (at
    # least one core's worth: the scheduler never starves a runnable thread for good).
    free = max(1.0, host_cores - background_cores) if host_cores else 0.0
    capacity, limit = _capacity(
        replicas, max_batch, service(max_batch), t, host_cores, free, cpu_per_call_s, mesh_max_rps
    )
    # The host's CPU a run waits for below saturation: none when alone on its cores, or when
    # service(b) was measured under load on this host.
    host_cpu = (open_cpu or (0.0, cpu_per_call_s)) if host_cores and not contended else None
    run = _under_load(service, offered_rps, t, free, host_cpu)
    batching = _continuous if continuous else _per_run
    return batching(
        offered_rps, replicas, max_batch, run, capacity, limit, mesh_latency_s, mesh_latency_p99_s
    )


def _capacity(
    replicas: int,
    max_batch: int,
    top: float,
    t: int,
    host_cores: float | None,
    free: float,
    cpu_per_call_s: float,
    mesh_max_rps: float,
) -> tuple[float, str]:
    """The saturation throughput and what caps it: the replicas (each running max_batch in
    `top` seconds), the host's free cores, or the mesh's serial path."""
    limits = {"replicas": replicas * max_batch / top}
    if host_cores:
        limits["host cores"] = free / (cpu_per_call_s + t * top / max_batch)
    if mesh_max_rps:
        limits["the mesh (router)"] = mesh_max_rps
    if host_cores:
        # At saturation every replica is busy and the mesh wants x times its CPU per call:
        # when that outnumbers the free cores each run stretches, which lowers x (fixed
        # point, from the unstretched rate down).
        x = min(limits.values())
        for _ in range(20):
            sigma = _stretch(replicas * t + x * cpu_per_call_s, free)
            limits["replicas"] = replicas * max_batch / (top * sigma)
            x = min(limits.values())
    limit = min(limits, key=lambda k: limits[k])
    return limits[limit], limit


def _under_load(
    service: Callable[[int], float],
    offered_rps: float,
    t: int,
    free: float,
    host_cpu: tuple[float, float] | None,
) -> Callable[[int], float]:
    """service(b) as a run of b takes under the offered load. Below saturation the free cores
    are themselves a queue: every call brings its CPU work (the mesh's per call, its share of
    a run) at random, so a run waits for a core as a call waits for a replica; its mean
    slowdown is M/M/n's response over service, 1 + C(n, a) / (n - a), a the cores' offered
    load. Where b is too small for the cores to keep up, calls queue at the replicas and the
    batch grows (settle_batch). `host_cpu`: (fixed cores, seconds per call), or None when a
    run waits for no core."""

    def run(b: int) -> float:
        s = service(b)
        if host_cpu is None:
            return s
        fixed, per_call = host_cpu
        return s * _host_slowdown(fixed + offered_rps * (per_call + t * s / b), free)

    return run


def _per_run(
    offered_rps: float,
    replicas: int,
    max_batch: int,
    run: Callable[[int], float],
    capacity: float,
    limit: str,
    mesh_latency_s: float,
    mesh_latency_p99_s: float,
) -> Prediction:
    """Batching per run (the dynamic batcher): the batch settles, a call waits out the run in
    progress, or near saturation M/D/c's queue at the batcher's top rate."""
    b = settle_batch(offered_rps / replicas, run, max_batch)
    s = between(run, b)
    if not math.isfinite(s):
        return Prediction(capacity, capacity, b, math.inf, math.inf, math.inf, limit, max_batch)
    # The chance a call finds its replica running: the busy fraction at the settled batch.
    busy = min(1.0, offered_rps / (replicas * b / s))
    util = offered_rps / capacity
    if util >= 1:
        return Prediction(capacity, capacity, b, util, math.inf, math.inf, limit, max_batch)
    # A call that finds its replica busy waits out the run in progress, uniform over 0..s,
    # and rides the next batch, which takes whatever waits, up to max_batch: calls queue
    # beyond one run only as the batches near max_batch, so the queue's tail is M/D/c's at
    # the batcher's top rate, max_batch / S(max_batch) per replica.
    top = run(max_batch)
    if not math.isfinite(top):
        return Prediction(capacity, capacity, b, math.inf, math.inf, math.inf, limit, max_batch)
    mu = max_batch / top
    if offered_rps >= replicas * mu:  # the runs slowed by the cores' queue cannot keep up
        return Prediction(capacity, capacity, b, 1.0, math.inf, math.inf, limit, max_batch)
    c_wait = erlang_c(replicas, offered_rps / mu)
    theta = md_c_decay(offered_rps, replicas, 1 / mu)
    q99, q50 = wait_quantile(c_wait, theta, 0.01), wait_quantile(c_wait, theta, 0.5)
    residual99 = s * max(0.0, 1 - 0.01 / busy) if busy > 0 else 0.0
    p99 = (mesh_latency_p99_s or mesh_latency_s) + s + max(residual99, q99)
    p50 = mesh_latency_s + s + s * busy / 2 + q50
    return Prediction(capacity, offered_rps, b, util, p50, p99, limit, max_batch)


def _continuous(
    offered_rps: float,
    replicas: int,
    max_batch: int,
    run: Callable[[int], float],
    capacity: float,
    limit: str,
    mesh_latency_s: float,
    mesh_latency_p99_s: float,
) -> Prediction:
    """Iteration-level batching (worker/llm/engine.py): a call joins the running sequences at
    the next step instead of waiting for a batch to end, so a replica is max_batch slots and
    a generation holds one for T(k), the time of a generation among k running ones (run(k):
    k prefills and the shared decode steps). k settles where Little's law puts it,
    k = lam / c x T(k) (interpolated between whole batches); a call waits only when every
    slot is taken: M/D/m over m = c x max_batch slots (Erlang C, M/D/c's tail). The 99th
    percentile call is also a slow one: it arrives (Poisson arrivals see the time average)
    while more sequences run than the mean, and every step it shares is slower. The others
    running on its replica are M/G/inf's Poisson(lam / c x T), so it takes T(k99), k99 = 1 +
    that count's 99th percentile, at most max_batch."""

    k = 1.0
    for _ in range(50):
        k = min(float(max_batch), max(1.0, offered_rps / replicas * between(run, k)))
    t = between(run, k)
    slots = replicas * max_batch
    util = offered_rps / capacity
    if not math.isfinite(t) or util >= 1 or offered_rps * t >= slots:
        return Prediction(
            capacity, capacity, k, max(util, 1.0), math.inf, math.inf, limit, max_batch
        )
    c_wait = erlang_c(slots, offered_rps * t)
    theta = md_c_decay(offered_rps, slots, t)
    q99, q50 = wait_quantile(c_wait, theta, 0.01), wait_quantile(c_wait, theta, 0.5)
    crowded = min(float(max_batch), 1.0 + poisson_quantile(offered_rps / replicas * t, 0.99))
    p99 = (mesh_latency_p99_s or mesh_latency_s) + max(t, between(run, crowded)) + q99
    return Prediction(
        capacity, offered_rps, k, util, mesh_latency_s + t + q50, p99, limit, max_batch
    )
