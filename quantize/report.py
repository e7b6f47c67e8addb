"""Evaluation reports: one JSON and one markdown file per (model, recipe)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import onnxruntime

from quantize.recipes import Recipe


def build(
    model: str,
    recipe: Recipe,
    metrics: dict,
    failures: list[str],
    paths: dict[str, Path],
    latency: dict,
    seconds: float,
) -> dict:
    sizes = {k: p.stat().st_size for k, p in paths.items()}
    fp32, quantized = next(iter(sizes.values())), sizes[recipe.name]
    return {
        "model": model,
        "recipe": recipe.name,
        "purpose": recipe.purpose,
        "verdict": "refused" if failures else "accepted",
        "failures": failures,
        "gate": [{"metric": t.metric, "op": t.op, "threshold": t.value} for t in recipe.gate],
        "metrics": metrics,
        "size_bytes": sizes,
        "size_ratio": round(quantized / fp32, 3),
        "latency_ms": latency,
        "evaluated_on": recipe.provider,
        "machine": {"python": platform.python_version(), "onnxruntime": onnxruntime.__version__},
        "seconds": round(seconds, 1),
    }


def markdown(r: dict) -> str:
    lines = [
        f"# {r['model']} / {r['recipe']}: {r['verdict'].upper()}",
        "",
        r["purpose"],
        "",
        "## Gate",
        "",
        "| metric | measured | threshold | ok |",
        "|---|---|---|---|",
    ]
    for g in r["gate"]:
        value = r["metrics"][g["metric"]]
        ok = value >= g["threshold"] if g["op"] == ">=" else value <= g["threshold"]
        lines.append(f"| {g['metric']} | {value:.4f} | {g['op']} {g['threshold']} | {ok} |")
    others = [k for k in r["metrics"] if k not in {g["metric"] for g in r["gate"]}]
    lines += ["", "Also measured: " + ", ".join(f"{k} {r['metrics'][k]:.4f}" for k in others)]
    sizes = r["size_bytes"]
    lines += [
        "",
        "## Size",
        "",
        ", ".join(f"{k}: {v / 1e6:.1f} MB" for k, v in sizes.items())
        + f" (ratio {r['size_ratio']})",
    ]
    if r["latency_ms"]:
        lines += ["", "## Latency (median ms, onnxruntime CPU, measured in alternation)", ""]
        for batch, per_file in r["latency_ms"].items():
            lines.append(f"- {batch}: " + "; ".join(f"{k} {v}" for k, v in per_file.items()))
    return "\n".join(lines) + "\n"


def write(folder: Path, name: str, body: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(body, indent=2) + "\n")
    (folder / f"{name}.md").write_text(markdown(body))
