"""The balancing policies as pure functions, with fake replicas and a seeded rng."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.policy import Candidate, choose, load


def cands(*loads: int, max_queue: int = 100) -> list[Candidate]:
    return [Candidate(f"w{i}", n, max_queue) for i, n in enumerate(loads)]


def test_load_adds_calls_sent_after_the_sample() -> None:
    # Sampled at t=1000 with depth 3; our calls started at 900 (already counted) and 1100.
    assert load(3, 1000, [900, 1100], now_ms=1200, max_age_ms=500) == 4


def test_stale_sample_counts_as_unknown() -> None:
    assert load(50, 1000, [900, 1100], now_ms=5000, max_age_ms=500) == 2
    assert load(None, None, [1, 2, 3], now_ms=5000, max_age_ms=500) == 3


def test_p2c_takes_the_less_loaded_of_two() -> None:
    rng = random.Random(0)
    picks = Counter(choose("p2c", cands(0, 10), rng, 0).id for _ in range(200))
    assert picks == {"w0": 200}


def test_p2c_never_picks_the_most_loaded_of_three() -> None:
    rng = random.Random(1)
    picks = Counter(choose("p2c", cands(1, 2, 9), rng, 0).id for _ in range(600))
    assert picks["w2"] == 0
    assert picks["w0"] > picks["w1"] > 0


def test_p2c_spreads_ties() -> None:
    rng = random.Random(2)
    picks = Counter(choose("p2c", cands(0, 0, 0, 0), rng, 0).id for _ in range(4000))
    assert all(800 < n < 1200 for n in picks.values())


def test_least_loaded() -> None:
    assert choose("least_loaded", cands(5, 1, 3), random.Random(0), 0).id == "w1"


def test_round_robin_cycles_in_id_order() -> None:
    c = cands(9, 0, 5)
    assert [choose("round_robin", c, random.Random(0), t).id for t in range(6)] == [
        "w0",
        "w1",
        "w2",
        "w0",
        "w1",
        "w2",
    ]


def test_random_ignores_load() -> None:
    rng = random.Random(3)
    picks = Counter(choose("random", cands(0, 1000), rng, 0).id for _ in range(1000))
    assert 400 < picks["w1"] < 600


def test_full_and_unknown_policy() -> None:
    assert Candidate("w", 4, 4).full and not Candidate("w", 3, 4).full
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        choose("fastest", cands(1, 2), random.Random(0), 0)
