"""The sentences the benchmarks print, each computed from the numbers it reads.

Pure functions of the result dicts in benchmarks/results/*.json: a comparison says
"faster" or "slower", a target "meets" or "misses", a difference "distinguishable from
noise" or not, as the numbers fall. Used by summary.py (benchmarks/README.md), tp.py and
ledger.py; tested in tests/benchmarks/ with result sets that flip every verdict.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from loadtest.results import markdown_table

SIGNIFICANCE = 0.05  # a sign-test p-value under this is told apart from run-to-run noise


def meets(value: float, target: float, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return "meets" if ok else "misses"


def trend(values: Sequence[float], tolerance: float = 0.2) -> str:
    """'falls', 'rises' or 'stays about flat' from the first value to the last."""
    first, last = values[0], values[-1]
    if last < first * (1 - tolerance):
        return "falls"
    if last > first * (1 + tolerance):
        return "rises"
    return "stays about flat"


# -- paired runs: accounting on vs off ---------------------------------------------------


def sign_test_p(positive: int, negative: int) -> float:
    """Two-sided exact sign test (ties dropped): how often a fair coin splits at least this
    unevenly."""
    n = positive + negative
    if n == 0:
        return 1.0
    k = min(positive, negative)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_cost(on: Sequence[float], off: Sequence[float]) -> dict:
    """Cost of a feature from alternated runs: per pair 1 - on/off (throughput lost when it is
    on), their median, IQR and range, and a sign test of "no difference"."""
    if len(on) != len(off) or not on:
        raise ValueError(f"need equal, non-empty run lists, got {len(on)} on and {len(off)} off")
    costs = [1 - a / b for a, b in zip(on, off, strict=True)]
    positive, negative = sum(c > 0 for c in costs), sum(c < 0 for c in costs)
    p = sign_test_p(positive, negative)
    q1, q3 = (float(x) for x in np.percentile(costs, [25, 75]))
    return {
        "pairs": len(costs),
        "cost_per_pair": [round(c, 4) for c in costs],
        "median": round(statistics.median(costs), 4),
        "iqr": [round(q1, 4), round(q3, 4)],
        "min": round(min(costs), 4),
        "max": round(max(costs), 4),
        "slower_with_it": positive,
        "faster_with_it": negative,
        "sign_test_p": round(p, 4),
        "distinguishable": p < SIGNIFICANCE,
        # the fewest pairs, all one way, that could reach SIGNIFICANCE at all
        "pairs_needed": next(n for n in range(1, 64) if sign_test_p(n, 0) < SIGNIFICANCE),
    }


def accounting_reading(s: dict) -> str:
    n = s["pairs"]
    spread = (
        f"over {n} alternated pairs the cost per pair has median {s['median']:.1%}, "
        f"IQR {s['iqr'][0]:.1%} to {s['iqr'][1]:.1%}, range {s['min']:.1%} to {s['max']:.1%}"
    )
    way = f"{s['slower_with_it']} of {n} pairs slower with accounting on"
    if s["distinguishable"]:
        direction = "costs" if s["median"] > 0 else "gains"
        return (
            f"Exact accounting {direction} {abs(s['median']):.1%} of router saturation "
            f"throughput: {spread}; {way} (sign test p = {s['sign_test_p']:.3f} < "
            f"{SIGNIFICANCE}), distinguishable from run-to-run noise."
        )
    short = (
        f"; {n} pairs cannot reach p < {SIGNIFICANCE} even all one way, {s['pairs_needed']} can"
        if n < s["pairs_needed"]
        else ""
    )
    return (
        f"The cost of exact accounting is not distinguishable from run-to-run noise: "
        f"{spread}; {way} (sign test p = {s['sign_test_p']:.2f}{short})."
    )


# -- router ---------------------------------------------------------------------------------

HOP_P50_TARGET = 1.5  # router p50 at c=1 at most 1.5x direct
HOP_THROUGHPUT_TARGET = 0.9  # router throughput at c=32 at least 0.9x direct


def hop_reading(hop: dict, cores: int) -> str:
    def ratio(path: str, c: str, key: str, base: str = "direct") -> float:
        return round(hop[path][c][key] / hop[base][c][key], 2)

    r_p50, r_tp = ratio("router", "c1", "p50_ms"), ratio("router", "c32", "throughput_rps")
    b_p50, b_tp = ratio("bare_proxy", "c1", "p50_ms"), ratio("bare_proxy", "c32", "throughput_rps")
    over_tp = ratio("router", "c32", "throughput_rps", "bare_proxy")
    over_p50 = ratio("router", "c1", "p50_ms", "bare_proxy")
    router_meets = (
        f"The router {meets(r_p50, HOP_P50_TARGET, True)} the target p50 <= "
        f"{HOP_P50_TARGET}x direct at c=1 ({r_p50}x) and "
        f"{meets(r_tp, HOP_THROUGHPUT_TARGET, False)} throughput >= "
        f"{HOP_THROUGHPUT_TARGET}x direct at c=32 ({r_tp}x); a bare grpc.aio proxy "
        f"{meets(b_p50, HOP_P50_TARGET, True)} the first ({b_p50}x) and "
        f"{meets(b_tp, HOP_THROUGHPUT_TARGET, False)} the second ({b_tp}x)."
    )

    def cost(what: str, ratio_: float, of: str) -> str:
        if ratio_ >= 1:
            return f"{what} cost no throughput in this run"
        return f"{what} costs {1 - ratio_:.0%} of {of} throughput"

    own = cost("its own work (balancing, accounting, metrics)", over_tp, "the bare proxy's")
    relative = (
        f" The router does {over_tp}x the bare proxy's throughput at c=32 and has "
        f"{over_p50}x its p50 at c=1: {own}, and {cost('the hop itself', b_tp, 'direct')}. "
        f"Client, router and worker share {cores} cores."
    )
    return router_meets + relative


def replicas_reading(label: str, rows: list[dict]) -> str:
    n = [r["workers"] for r in rows]
    p99 = [r["p99_ms"] for r in rows]
    per = [round(statistics.mean(r["per_worker_rps"]), 1) for r in rows]
    return (
        f"{label}: from {n[0]} to {n[-1]} workers, p99 {trend(p99)} "
        f"({' -> '.join(f'{x}' for x in p99)} ms) while each worker's load goes "
        f"{' -> '.join(f'{x}' for x in per)} req/s."
    )


def client_limited_reading(rows: list[tuple[str, dict]]) -> str:
    """Open-loop points whose load generator fell behind its schedule (loadtest flags them);
    empty when none did, or the results predate the flag."""
    limited = [f"{label} ({r['client']['reason']})" for label, r in rows if r.get("client_limited")]
    if not limited:
        return ""
    return (
        "Client-limited, so measuring the load generator rather than the mesh: "
        + "; ".join(limited)
        + "."
    )


def policies_reading(rows: list[dict]) -> str:
    by = {r["policy"]: r for r in rows}
    fair = 1 / 3
    p2c, rnd = by["p2c"], by["random"]
    ratio = round(p2c["p99_ms"] / rnd["p99_ms"], 3)
    better = "lower" if ratio < 1 else "higher"
    return (
        f"p2c's p99 is {ratio}x random's ({p2c['p99_ms']} vs {rnd['p99_ms']} ms, "
        f"{better}); the slow replica got {p2c['slow_share']:.1%} of p2c's calls and "
        f"{rnd['slow_share']:.1%} of random's, against an even share of {fair:.1%}."
    )


# -- MLServer ---------------------------------------------------------------------------------


def mlserver_reading(summary: dict, names: dict[str, str]) -> str:
    """Where meshserve's p99 or throughput is worse than MLServer's, at every concurrency."""
    worse_p99, worse_tp = [], []
    for key, v in summary.items():
        if not isinstance(v, dict):
            continue
        ours, rest = key.split("_over_")
        c = rest.rsplit("_c", 1)[1]
        where = f"{names.get(ours, ours)} at c={c}"
        if v["p99_ratio"] is not None and v["p99_ratio"] > 1:
            worse_p99.append(f"{where} ({v['p99_ratio']}x)")
        if v["throughput_ratio"] < 1:
            worse_tp.append(f"{where} ({v['throughput_ratio']}x)")
    p99 = "Points where meshserve's p99 is worse than MLServer's: " + (
        "; ".join(worse_p99) if worse_p99 else "none"
    )
    tp = "points where its throughput is lower: " + ("; ".join(worse_tp) if worse_tp else "none")
    return f"{p99}. {tp[0].upper()}{tp[1:]}."


# -- tensor parallelism -------------------------------------------------------------------------


def _rows(latency: dict) -> dict[str, dict[tuple[int, int], dict]]:
    return {b: {(r["tp"], r["threads_per_rank"]): r for r in v} for b, v in latency.items()}


def _replicated_mb(weights: dict[str, list[int]]) -> tuple[float, int, float, float] | None:
    """(bytes per rank at TP1, largest N, bytes per rank at TP N, replicated part), MB; the
    replicated part solves per_rank(N) = R + (TP1 - R) / N."""
    tps = sorted(int(k.removeprefix("tp")) for k in weights)
    if len(tps) < 2 or tps[0] != 1:
        return None
    n = tps[-1]
    one, at_n = max(weights["tp1"]) / 1e6, max(weights[f"tp{n}"]) / 1e6
    return one, n, at_n, max(0.0, (n * at_n - one) / (n - 1))


def _latency_part(model: str, rows: dict) -> tuple[str, list[str]]:
    parts, faster = [], []
    for batch, by in rows.items():
        threads = max(t for tp, t in by if tp == 1)  # TP1 with every core
        base = by[(1, threads)]["total_ms"]
        tps = sorted(tp for tp, threads in by if tp > 1 and threads == 1)
        cells = []
        for tp in tps:
            total = by[(tp, 1)]["total_ms"]
            cells.append(f"TP{tp} {total} ms ({total / base:.2f}x)")
            if total < base:
                faster.append(f"TP{tp} at {batch}")
        parts.append(
            f"{batch.replace('batch', 'batch ')}: TP1 with {threads} threads {base} ms, "
            + ", ".join(cells)
        )
    return f"{model} — " + "; ".join(parts) + ".", faster


def _split_part(model: str, by: dict, cores: int) -> str:
    one = by[(1, 1)]["compute_ms"]
    out = []
    for tp in sorted(tp for tp, threads in by if tp > 1 and threads == 1):
        r = by[(tp, 1)]
        share = r["comm_ms"] / r["total_ms"] if r["total_ms"] else 0.0
        crowded = f", {tp} ranks on {cores} cores" if tp > cores else ""
        out.append(
            f"at TP{tp} rank 0's compute is {r['compute_ms']} ms, {r['compute_ms'] / one:.2f}x "
            f"one thread's {one} ms (an even split is {1 / tp:.2f}x), and communication "
            f"{r['comm_ms']} ms, {share:.0%} of its total{crowded}"
        )
    return f"{model}, largest batch: " + "; ".join(out) + "."


def tp_reading(p: dict) -> str:
    cores = p["machine"]["cores"]
    sentences, faster, lighter = [], [], []
    for model, label in (("minilm", "MiniLM"), ("smollm2", "SmolLM2")):
        if model not in p:
            continue
        d = p[model]
        rows = _rows(d["latency"])
        text, fast = _latency_part(label, rows)
        sentences.append(text)
        faster += [f"{label} {f}" for f in fast]
        largest = max(rows, key=lambda b: int(b.removeprefix("batch")))
        split = _split_part(label, rows[largest], cores)
        if "config_layers" in d and "new_tokens" in d:
            calls = d["new_tokens"] * (2 * d["config_layers"] + 1)
            worst = max(tp for tp, _ in rows[largest])
            per = rows[largest][(worst, 1)]["comm_ms"] / calls
            split = split[:-1] + (
                f"; {calls} collectives per generation ({2 * d['config_layers'] + 1} per "
                f"token), ~{per:.2f} ms each at TP{worst}."
            )
        sentences.append(split)
        weights = _replicated_mb(d["weight_bytes_per_rank"])
        if weights:
            one, n, at_n, rep = weights
            if at_n < one:
                lighter.append(label)
            sentences.append(
                f"{label} weights per rank: {one:.0f} MB at TP1 -> {at_n:.0f} MB at TP{n} "
                f"({at_n / one:.2f}x; an even split is {1 / n:.2f}x): about {rep:.0f} MB "
                "per rank is replicated, not sharded."
            )
    if faster:
        verdict = f"On {cores} CPU cores TP beats one process using every core at: " + (
            ", ".join(faster) + "."
        )
    else:
        verdict = (
            f"On {cores} CPU cores TP is slower than one process using every core at every "
            "point measured"
        )
        verdict += (
            f"; it pays only in weight bytes per rank ({', '.join(lighter)})."
            if lighter
            else ", and its weight bytes per rank do not fall either."
        )
    return " ".join([verdict, *sentences])


table = markdown_table  # the sections' Markdown tables: loadtest/results.py owns the format
