"""The validation's report, rendered from planner.json: its summary rows (what
benchmarks/README.md shows) and its full section (`python -m planner validate report`).
Every verdict is computed from the numbers."""

from __future__ import annotations

from loadtest.results import check, markdown_table

COMMAND = "python -m planner validate"
TITLE = "Planner: predicted against measured"
HEADER = [
    "configuration",
    "bound",
    "req/s",
    "roofline",
    "calibrated",
    "served",
    "offered /s",
    "p99 ms",
    "roofline",
    "calibrated",
    "served",
    "batch",
    "background",
    "other",
]


def _pct(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:+.0%}"


def _share(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.0%}"  # null in JSON: a queue that never settles


def _ms(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.1f}"  # the queue never settles


def _row(c: dict) -> list[object]:
    m, roof, cal = c["measured"], c["roofline"], c["calibrated"]
    served = c.get("served", cal)
    return [
        c["config"],
        c["diagnosis"]["bound"],
        round(m["throughput_rps"], 2),
        f"{roof['capacity_rps']:.1f} ({_pct(roof['throughput_error'])})",
        f"{cal['capacity_rps']:.1f} ({_pct(cal['throughput_error'])})",
        f"{served['capacity_rps']:.1f} ({_pct(served['throughput_error'])}, {served['limit']})",
        round(m["offered_rps"], 2),
        round(m["p99_ms"], 1),
        f"{_ms(roof['p99_ms'])} ({_pct(roof['p99_error'])})",
        f"{_ms(cal['p99_ms'])} ({_pct(cal['p99_error'])})",
        f"{_ms(served['p99_ms'])} ({_pct(served['p99_error'])})",
        f"{m['closed']['mean_batch']:.1f} / {m['open']['mean_batch']:.1f}",
        m.get("background_cores", 0.0),
        f"{m['closed'].get('other_cores', 0.0):.2f} / {m['open'].get('other_cores', 0.0):.2f}",
    ]


def _verdicts(s: dict) -> str:
    def verdict(m: dict, label: str) -> str:
        return f"{label}: " + ", ".join(
            f"{k} median |error| {_share(m[f'median_abs_{k}_error'])} (target "
            f"{s['targets'][k]:.0%}: {'met' if m['met'][k] else 'missed'})"
            for k in ("throughput", "p99")
        )

    return (
        verdict(s["roofline"], "Roofline only")
        + "; "
        + verdict(s["calibrated"], "calibrated")
        + (("; " + verdict(s["served"], "served")) if "served" in s else "")
        + "."
    )


def _calibrations(r: dict) -> str:
    return "; ".join(
        f"{k}: {v['runs_ms']} ms by batch, {v['call_overhead_ms']} ms fixed per run, "
        f"efficiency {v['efficiency']}"
        + (f", prefill {v['prefill_ms']} ms" if v["prefill_ms"] else "")
        for k, v in r["calibrations"].items()
    )


def _servings(r: dict) -> str:
    def tail(v: dict) -> str:
        points = v["served"][-1].get("tail") or []
        return (
            ", trip tail "
            + ", ".join(
                f"p99 {p99 * 1e3:.0f} ms at {rate:.0f}/s ({busy:.2f} cores busy)"
                for busy, p99, rate in points
            )
            if points
            else ""
        )

    return "; ".join(
        f"{k}: {v['cycles_ms']} ms per batch by batch{tail(v)}"
        for k, v in r.get("servings", {}).items()
    )


def _method(r: dict) -> str:
    p = r["profile"]
    return (
        f"`{COMMAND}` — {r['machine_note']}. Profile: {p['source']}; "
        f"mesh {p['mesh_latency_s'] * 1e3:.1f} ms (p99 {p['mesh_latency_p99_s'] * 1e3:.1f} "
        f"ms at a quarter of its top rate) and {p['mesh_cpu_s'] * 1e3:.2f} CPU-ms per call, "
        f"at most {p['mesh_max_rps']:.0f} calls/s. Throughput: the saturation throughput of "
        "a closed loop with 4 x replicas x max batch callers (8 to 64); p99: an open loop at "
        "half the measured throughput (offered /s). *Roofline*: predicted from the probe "
        "and the graph alone; *calibrated*: the Roofline fitted to each model's own "
        "session timed alone, outside the mesh (CPU time, one thread, batch 1 and the "
        f"largest): {_calibrations(r)}; *served*: fitted to each encoder served through a "
        "one-worker mesh (planner/serving.py; seconds per batch and host CPU per call at "
        "saturation at batch limits 2 and 16, which no checked row uses, and the trip's "
        f"tail under Poisson arrivals at a quarter, half and three quarters of the 16's "
        f"rate): {_servings(r)}; the LLM rows' *served* is "
        "the calibrated prediction. Batch: what the workers formed in the closed / open "
        "loop. Background: other jobs' CPU demand (cores) measured just before each row; "
        "other: their cores during the closed / open loop (the host's busy cores less ours)."
        + (f" The {r['reanalysed']}." if r.get("reanalysed") else "")
    )


def section(r: dict) -> str:
    misses = [
        f"- **{c['config']}**: " + "; ".join(c["explanation"])
        for c in r["configurations"]
        if c["explanation"]
    ]
    return "\n\n".join(
        [
            "## Planner: predicted against measured",
            _method(r),
            markdown_table(HEADER, [_row(c) for c in r["configurations"]]),
            _verdicts(r["accuracy"]),
            "Misses of the best prediction and why:\n\n" + "\n".join(misses)
            if misses
            else "No misses.",
            "![roofline](results/planner_roofline.png)",
        ]
    )


def rows(r: dict) -> list[list]:
    """Summary rows: each prediction's median |error| against its target."""
    a = r["accuracy"]
    return [
        check(f"{how}: median |{k} error|", a[how][f"median_abs_{k}_error"], a["targets"][k], True)
        for how in ("roofline", "calibrated", "served")
        if how in a
        for k in ("throughput", "p99")
    ]
