"""Balancing policies: pure functions of (candidates, rng, tick). No clock, no network.

`load` turns what the router knows about a replica into one number: the queue depth the
worker last published, plus the calls this router sent it after that sample was taken (the
sample cannot include them yet). A sample older than `max_age_ms` counts as unknown and only
the router's own in-flight calls remain: acting on stale least-loaded data makes every router
herd onto the same replica (Mitzenmacher, "How useful is old information?").
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

POLICIES = ("p2c", "least_loaded", "round_robin", "random")


@dataclass(frozen=True)
class Candidate:
    id: str
    load: int
    max_queue: int

    @property
    def full(self) -> bool:
        return self.load >= self.max_queue


def load(
    depth: int | None,
    sampled_ms: int | None,
    inflight_started_ms: Iterable[int],
    now_ms: int,
    max_age_ms: int,
) -> int:
    if depth is None or sampled_ms is None or now_ms - sampled_ms > max_age_ms:
        return sum(1 for _ in inflight_started_ms)
    return depth + sum(1 for t in inflight_started_ms if t > sampled_ms)


def choose(
    policy: str, candidates: Sequence[Candidate], rng: random.Random, tick: int
) -> Candidate:
    """Pick one of `candidates` (non-empty, none full)."""
    if len(candidates) == 1:
        return candidates[0]
    if policy == "p2c":
        a, b = rng.sample(list(candidates), 2)
        return a if a.load <= b.load else b
    if policy == "least_loaded":
        least = min(c.load for c in candidates)
        return rng.choice([c for c in candidates if c.load == least])
    if policy == "round_robin":
        return sorted(candidates, key=lambda c: c.id)[tick % len(candidates)]
    if policy == "random":
        return rng.choice(list(candidates))
    raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
