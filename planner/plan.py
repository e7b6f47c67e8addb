"""`python -m planner plan`: the cheapest replicas x TP x recipe x max batch predicted to
meet a p99 SLO at a given rate, with its cost, and what the runners-up lack.

Every candidate is priced at replicas x TP devices x the price per device-hour. Its
latency and capacity come from the Roofline run time (perfmodel/roofline.py) through the
M/D/c-with-batching model (perfmodel/queueing.py). An LLM call is one generation: a prompt of
`context` tokens and `max_tokens` decode steps; a replica batching b of them spends
b prefills + max_tokens decode steps of b sequences (at the mean context) per batch.
Break-even uses the ledger's own arithmetic (ledger/economics.py) with the model's price p
and training cost T from its config.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ledger.economics import economics
from perfmodel.analysis import DECODER, ModelAnalysis
from perfmodel.profiles import Profile
from perfmodel.queueing import Prediction, predict
from perfmodel.roofline import resident_bytes, run_seconds

TP_SIZES = (1, 2, 3, 4, 8)  # those that divide the model's KV heads
MAX_REPLICAS = 64


@dataclass(frozen=True)
class Workload:
    qps: float
    p99_s: float
    context: int = 0  # an LLM's prompt tokens (an encoder's item tokens when > 0)
    max_tokens: int = 0  # an LLM's generated tokens per call


@dataclass(frozen=True)
class Prices:
    per_device_hour_usd: float
    per_call_micro_usd: int = 0  # p
    training_cost_micro_usd: int = 0  # T
    per_1k_input_micro_usd: int = 0
    per_1k_output_micro_usd: int = 0


@dataclass
class Candidate:
    recipe: str
    replicas: int
    tp: int
    max_batch: int
    prediction: Prediction
    resident_bytes: int
    fits: bool
    cost_per_hour_usd: float
    meets: bool = False
    why: str = ""

    def row(self) -> dict:
        p = self.prediction
        return {
            "recipe": self.recipe,
            "replicas": self.replicas,
            "tp": self.tp,
            "max_batch": self.max_batch,
            "capacity_rps": round(p.capacity_rps, 1),
            "batch_at_load": round(p.batch, 2),
            "p99_ms": round(p.p99_s * 1e3, 2) if math.isfinite(p.p99_s) else None,
            "cost_per_hour_usd": round(self.cost_per_hour_usd, 4),
            "meets_slo": self.meets,
            "why_not": self.why,
        }


@dataclass
class Plan:
    model: str
    profile: str
    workload: Workload
    best: Candidate | None
    runners_up: list[Candidate]
    economics: dict = field(default_factory=dict)
    queueing: str = (
        "M/D/c with batching: Poisson arrivals, c replicas, deterministic batch time S(b) "
        "from the Roofline; b settles at lam/c x S(b); p99 = S(b) + the larger of the run in "
        "progress and M/D/c's queue tail (Erlang C, M/D/c's own decay rate)"
    )


def service_time(
    m: ModelAnalysis,
    profile: Profile,
    w: Workload,
    tp: int,
    threads: int | None = None,
    prefill_s: float | None = None,
) -> Callable[[int], float]:
    """Seconds one replica takes for a batch of b calls. A generation is one prefill run of
    its prompt, which yields the first token, then max_tokens - 1 decode steps shared by the
    batch (worker/llm/engine.py). `prefill_s`: a measured prefill run instead of the
    Roofline's (planner/calibrate.py)."""

    def encoder(b: int) -> float:
        return run_seconds(m, profile, b, tp=tp, threads=threads, tokens=w.context or None)

    def generation(b: int) -> float:
        prefill = prefill_s
        if prefill is None:
            fp, bp = m.prefill(max(w.context, 1))
            dtype = m.compute_dtype(profile.kind)
            prefill = max(fp / tp / profile.peak(dtype, threads), bp / profile.bandwidth())
            prefill += profile.call_overhead_s
        step = run_seconds(m, profile, b, w.context + w.max_tokens // 2, tp, threads)
        return b * prefill + max(w.max_tokens - 1, 0) * step

    return generation if m.kind == DECODER else encoder


def _tp_sizes(m: ModelAnalysis, profile: Profile) -> list[int]:
    if not profile.interconnect_bandwidth:
        return [1]  # no device link in the profile (a probed CPU): TP is not considered
    return [t for t in TP_SIZES if not m.kv_heads or m.kv_heads % t == 0]


def _batches(m: ModelAnalysis, cap: int) -> list[int]:
    top = m.max_batch_size or cap
    return [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max(top, 1)] or [1]


def candidates(
    analyses: list[ModelAnalysis],
    profile: Profile,
    w: Workload,
    price_per_device_hour: float,
    max_batch_cap: int = 64,
    shared_host: bool = False,
    threads: int | None = None,
) -> list[Candidate]:
    out = []
    for m in analyses:
        for tp in _tp_sizes(m, profile):
            for b in _batches(m, max_batch_cap):
                sequences = b if m.kind == DECODER else 0
                resident = resident_bytes(m, tp, sequences, w.context + w.max_tokens)
                fits = resident <= profile.memory_bytes
                service = service_time(m, profile, w, tp, threads)
                for replicas in range(1, MAX_REPLICAS + 1):
                    pred = predict(
                        w.qps,
                        replicas,
                        b,
                        service,
                        profile.mesh_latency_s,
                        host_cores=profile.cores if shared_host else None,
                        cpu_per_call_s=profile.mesh_cpu_s,
                        threads_per_replica=threads or 1,
                        mesh_max_rps=profile.mesh_max_rps if shared_host else 0.0,
                        background_cores=profile.background_cores if shared_host else 0.0,
                        mesh_latency_p99_s=profile.mesh_latency_p99_s,
                        open_cpu=profile.open_cpu() if shared_host else None,
                        continuous=m.kind == DECODER,
                    )
                    cand = Candidate(
                        m.recipe,
                        replicas,
                        tp,
                        b,
                        pred,
                        resident,
                        fits,
                        replicas * tp * price_per_device_hour,
                    )
                    cand.meets = fits and pred.utilisation < 1 and pred.p99_s <= w.p99_s
                    cand.why = _why(cand, profile, w)
                    out.append(cand)
                    if cand.meets or not fits:
                        break  # more replicas only cost more
    return out


def _why(c: Candidate, profile: Profile, w: Workload) -> str:
    p = c.prediction
    if not c.fits:
        return (
            f"does not fit: {c.resident_bytes / 1e9:.2f} GB per device > "
            f"{profile.memory_bytes / 1e9:.0f} GB (capacity-bound)"
        )
    if p.utilisation >= 1:
        return f"too slow: capacity {p.capacity_rps:,.1f}/s <= {w.qps:g}/s (limit: {p.limit})"
    if p.p99_s > w.p99_s:
        return f"misses the SLO: p99 {p.p99_s * 1e3:.1f} ms > {w.p99_s * 1e3:g} ms"
    return ""


def choose(cands: list[Candidate], runners: int = 4) -> tuple[Candidate | None, list[Candidate]]:
    ok = sorted(
        (c for c in cands if c.meets), key=lambda c: (c.cost_per_hour_usd, c.prediction.p99_s)
    )
    best = ok[0] if ok else None
    # Runners-up: the cheapest meeting one of each other recipe/TP, and the best miss of each.
    seen: set[tuple[str, int, bool]] = set()
    rest = []
    pool = ok[1:] + sorted(
        (c for c in cands if not c.meets),
        key=lambda c: (-c.replicas * c.tp, c.prediction.p99_s),
    )
    for c in pool:
        key = (c.recipe, c.tp, c.meets)
        if key in seen:
            continue
        seen.add(key)
        rest.append(c)
    return best, rest[:runners]


def break_even(best: Candidate, prices: Prices, w: Workload, now: dt.datetime) -> dict:
    """Cost per call (and per 1k output tokens) and the ledger's break-even at this rate."""
    calls_per_day = w.qps * 86_400
    serving_per_day = int(best.cost_per_hour_usd * 24 * 1_000_000)
    per_call = prices.per_call_micro_usd + math.ceil(
        (w.context * prices.per_1k_input_micro_usd + w.max_tokens * prices.per_1k_output_micro_usd)
        / 1000
    )
    calls = int(calls_per_day)
    # One day's calls as N, with `now` a day ahead: the ledger projects from N already served.
    e = economics(
        "plan",
        calls,
        0,
        per_call * calls,
        per_call,
        prices.training_cost_micro_usd,
        serving_per_day,
        calls_per_day,
        now + dt.timedelta(days=1),
    )
    out = {
        "cost_per_hour_usd": round(best.cost_per_hour_usd, 4),
        "cost_per_call_usd": best.cost_per_hour_usd / (w.qps * 3600),
        "revenue_per_call_micro_usd": per_call,
        "break_even_calls": e.break_even_calls,
        "break_even_date": e.projected_break_even,
        "statement": e.statement,
    }
    if e.break_even_calls is not None and e.break_even_calls <= calls:
        out["statement"] = (
            f"break-even after {e.break_even_calls:,} calls: within the first day at this rate"
        )
    if w.max_tokens:
        out["cost_per_1k_output_tokens_usd"] = (
            best.cost_per_hour_usd / (w.qps * 3600 * w.max_tokens) * 1000
        )
    return out


def plan(
    analyses: list[ModelAnalysis],
    profile: Profile,
    w: Workload,
    prices: Prices,
    now: dt.datetime | None = None,
    shared_host: bool = False,
    threads: int | None = None,
) -> Plan:
    cands = candidates(
        analyses, profile, w, prices.per_device_hour_usd, shared_host=shared_host, threads=threads
    )
    best, rest = choose(cands)
    result = Plan(analyses[0].name, profile.name, w, best, rest)
    if best is not None:
        result.economics = break_even(best, prices, w, now or dt.datetime.now(dt.UTC))
    return result
