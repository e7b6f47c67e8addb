"""This machine's CPU as /proc/cpuinfo names it: its model and its instruction-set flags.

One reader for the worker (which of a model's files to serve: worker/config.model_filename),
the planner's probe, and the machine recorded in result files (loadtest/results.machine).
A machine without /proc/cpuinfo reads as an unknown CPU with no flags.
"""

from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def _read() -> tuple[str, frozenset[str]]:
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        lines = []
    name, flags = None, frozenset[str]()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name is None:
            name = value.strip()
        elif key.strip() == "flags":
            flags = frozenset(value.split())
            break  # every core lists the same flags
    return name or "unknown CPU", flags


def name() -> str:
    return _read()[0]


def flags() -> frozenset[str]:
    return _read()[1]
