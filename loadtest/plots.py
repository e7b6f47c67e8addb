"""PNG plots from load-test results: latency CDF, and latency against offered load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(run: dict) -> str:
    if "concurrency" in run:
        return f"c={run['concurrency']}"
    return f"{run['offered_rps']:g} rps offered"


def latency_cdf(runs: list[tuple[str, dict]], path: Path, title: str = "Latency") -> Path:
    """Latency by percentile, the x axis in "nines" (90, 99, 99.9, ...) so the tail shows."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs:
        points = [(p, ms) for p, ms in run.get("cdf", []) if p < 100.0]
        if not points:
            continue
        pct = np.array([p for p, _ in points])
        ax.plot(1 / (1 - pct / 100), [ms for _, ms in points], label=name)
    ticks = [1, 2, 10, 100, 1000, 10000]
    ax.set_xscale("log")
    ax.set_xticks(ticks, ["0%", "50%", "90%", "99%", "99.9%", "99.99%"])
    ax.set(xlabel="percentile", ylabel="latency (ms)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def latency_vs_load(
    series: dict[str, list[dict]], path: Path, title: str = "Latency vs load"
) -> Path:
    """p50 and p99 against offered load (open loop) or achieved throughput (closed loop)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, runs in series.items():
        xs = [r.get("offered_rps", r["throughput_rps"]) for r in runs]
        for key, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
            ax.plot(xs, [r[key] for r in runs], style, label=f"{name} {key[:-3]}")
    offered = any("offered_rps" in r for runs in series.values() for r in runs)
    ax.set(
        xlabel="offered load (req/s)" if offered else "throughput (req/s)",
        ylabel="latency (ms)",
        yscale="log",
        title=title,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def tokens_vs_load(runs: list[dict], path: Path, title: str = "Output tokens/s") -> Path:
    """LLM mode: aggregate output tokens/s (left axis) and the median stream's tokens/s
    (right axis) against concurrency (closed loop) or offered requests/s (open loop)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    closed = all("concurrency" in r for r in runs)
    xs = [r["concurrency"] if closed else r["offered_rps"] for r in runs]
    ax.plot(xs, [r["output_tokens_per_s"] for r in runs], "o-", label="aggregate")
    ax.set(
        xlabel="concurrency" if closed else "offered load (req/s)",
        ylabel="aggregate output tokens/s",
        title=title,
    )
    per_stream = ax.twinx()
    medians = [r["stream_tokens_per_s"].get("p50") for r in runs]
    per_stream.plot(xs, medians, "s--", color="tab:orange", label="per stream (p50)")
    per_stream.set_ylabel("tokens/s of one stream (p50)")
    ax.set_ylim(bottom=0)
    per_stream.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()[0] + per_stream.get_legend_handles_labels()[0]
    ax.legend(lines, [str(line.get_label()) for line in lines], fontsize=8)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
