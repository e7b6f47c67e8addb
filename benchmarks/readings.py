"""Paired runs' statistics and the sentence they make, computed from the numbers: a
difference is "distinguishable from noise" or not as a sign test says (benchmarks/ledger.py's
accounting on/off pairs; tested with result sets that flip the verdict).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

SIGNIFICANCE = 0.05  # a sign-test p-value under this is told apart from run-to-run noise


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
