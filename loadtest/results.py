"""What a measured run's result file holds besides its numbers: the machine it ran on, the
JSON written so every parser reads it, and its rows as a Markdown table. The benchmarks
(benchmarks/common.py) and the planner's validation (planner/validate/) write theirs
through this.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from pathlib import Path

import onnxruntime

from common import cpu

# The vector instruction sets onnxruntime's CPU kernels (MLAS) pick their kernels by: a VM's
# "AMD EPYC" has run with AVX-512 and VNNI one day and AVX2 only the next, and the int8 and
# int4 MatMulNBits kernels rank differently on the two (docs/decisions.md, "int4 weights
# where the CPU lacks VNNI").
SIMD = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")


def machine() -> dict:
    """The CPU model and vector instruction sets, cores, Python, onnxruntime and platform of
    this machine."""
    flags = cpu.flags()
    return {
        "cpu": cpu.name(),
        "simd": [f for f in SIMD if f in flags],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "platform": platform.platform(),
    }


def describe(m: dict) -> str:
    """A machine() dict in a few words, for a results file's summary."""
    have = m.get("simd", [])
    simd = [f for f in have if f.startswith(("avx512f", "amx"))]
    simd = simd or ["avx2 only"] * ("avx2" in have)
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores" + (
        f" ({', '.join(simd)})" if simd else ""
    )


def check(label: str, value: float | None, target: float, at_most: bool, unit: str = "") -> list:
    """A summary row [label, value, target, verdict]: "met" or "missed" as the value falls
    against the target (no value: "not measured", "missed")."""
    bound = f"{'<=' if at_most else '>='} {target}{unit}"
    if value is None:
        return [label, "not measured", bound, "missed"]
    met = value <= target if at_most else value >= target
    return [label, f"{_round(value)}{unit}", bound, "met" if met else "missed"]


def figure(label: str, value: object, unit: str = "") -> list:
    """A summary row for a figure with no target."""
    return [label, f"{_round(value)}{unit}", "", ""]


def _round(value: object) -> object:
    return round(value, 3) if isinstance(value, float) else value


def summary_block(title: str, rows: list[list], machine_: dict, command: str) -> dict:
    """The top-level "summary" object every results file carries (benchmarks/summary.py
    renders it by discovery): title, machine, today's date, the command, headline rows."""
    return {
        "title": title,
        "machine": describe(machine_),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "command": command,
        "rows": rows,
    }


def write_json(path: Path, payload: dict) -> Path:
    """`payload` as indented JSON at `path`; a number that is not finite (no measurement)
    is written as null, which every JSON parser reads (Infinity and NaN are not JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n")
    return path


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
