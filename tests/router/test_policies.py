"""The balancing policies as pure objects, with fake replicas and a seeded rng."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
from prometheus_client import REGISTRY

from router.forwarding.policies import (
    POLICIES,
    Ask,
    Candidate,
    Policy,
    Setup,
    build,
    kv_free,
    kv_need,
    load,
)
from router.forwarding.policies.p2c import P2C


def choose(
    name: str,
    candidates: Sequence[Candidate],
    rng: random.Random,
    tick: int,
    need: int = 1,
    preferred: str | None = None,
) -> Candidate:
    """One pick of the policy named `name`, built on `rng`."""
    return build(name, Setup(rng)).choose(candidates, Ask(need, preferred, tick=tick))


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


# -- KV-aware p2c ------------------------------------------------------------------------


def kv(*pairs: tuple[int, int | None], max_queue: int = 100) -> list[Candidate]:
    """Fake LLM replicas from (load, free KV tokens) pairs."""
    return [Candidate(f"w{i}", n, max_queue, free) for i, (n, free) in enumerate(pairs)]


def test_kv_free_is_the_sampled_room_and_stale_is_unknown() -> None:
    assert kv_free(1000, 4096, 1000, now_ms=1200, max_age_ms=500) == 3096
    assert kv_free(10, 4096, 1000, now_ms=5000, max_age_ms=500) is None
    assert kv_free(0, 0, 1000, 1000, 500) is None  # no KV cache reported


def test_kv_need_is_tokens_held_per_sequence() -> None:
    assert kv_need([(2, 2000), (10, 520)]) == 210
    assert kv_need([(0, 0), (0, 0)]) == 1  # nothing runs: any room will do
    assert kv_need([]) == 1


def test_p2c_never_picks_a_full_cache_while_another_has_room() -> None:
    # w0: the shortest queue but its cache cannot hold an average request (need 50).
    rng = random.Random(4)
    c = kv((0, 10), (5, 3000), (7, 60), (6, 900))
    picks = Counter(choose("p2c", c, rng, 0, need=50).id for _ in range(600))
    assert picks["w0"] == 0
    assert picks["w1"] > picks["w3"] > 0  # p2c among those with room
    assert picks["w2"] == 0  # the longest queue of the three with room loses every pair


def test_plain_p2c_depth_ignores_the_cache() -> None:
    rng = random.Random(5)
    c = kv((0, 0), (5, 3000))
    picks = Counter(choose("p2c_depth", c, rng, 0, need=50).id for _ in range(200))
    assert picks == {"w0": 200}


def test_p2c_with_every_cache_full_falls_back_to_load_then_free_kv() -> None:
    rng = random.Random(6)
    assert {choose("p2c", kv((3, 10), (1, 0)), rng, 0, need=50).id for _ in range(50)} == {"w1"}
    # equal queues: the one with more free KV
    assert {choose("p2c", kv((2, 10), (2, 40)), rng, 0, need=50).id for _ in range(50)} == {"w1"}


def test_p2c_ties_on_load_go_to_more_free_kv() -> None:
    rng = random.Random(7)
    picks = Counter(choose("p2c", kv((1, 500), (1, 4000)), rng, 0, need=50).id for _ in range(100))
    assert picks == {"w1": 100}


def test_unknown_kv_counts_as_room_and_non_llm_replicas_are_plain_p2c() -> None:
    rng = random.Random(8)
    assert choose("p2c", kv((0, 0), (4, None)), rng, 0, need=50).id == "w1"
    picks = Counter(choose("p2c", cands(0, 10), rng, 0, need=50).id for _ in range(100))
    assert picks == {"w0": 100}


def test_one_roomy_replica_of_many_is_always_taken() -> None:
    rng = random.Random(9)
    c = kv((0, 0), (0, 5), (9, 900), (0, 1))
    assert {choose("p2c", c, rng, 0, need=100).id for _ in range(100)} == {"w2"}


# -- affinity ---------------------------------------------------------------------------


def test_preferred_replica_is_kept_while_it_has_room() -> None:
    rng = random.Random(10)
    c = kv((9, 500), (0, 4000))
    assert {choose("p2c", c, rng, 0, need=50, preferred="w0").id for _ in range(50)} == {"w0"}


def test_preferred_replica_full_or_gone_falls_back_to_p2c() -> None:
    rng = random.Random(11)
    c = kv((0, 10), (3, 4000))
    assert choose("p2c", c, rng, 0, need=50, preferred="w0").id == "w1"  # full
    assert choose("p2c", c, rng, 0, need=50, preferred="w7").id == "w1"  # gone


def test_load_is_never_below_the_routers_own_calls_in_flight() -> None:
    # A sample taken after three of our calls started that shows only one of them (the
    # others are still on their way to the worker): our three count.
    assert load(1, 1000, [900, 950, 990], now_ms=1001, max_age_ms=500) == 3


# -- the table -----------------------------------------------------------------------------


def test_every_policy_is_registered_by_its_own_name_and_only_prefix_reads_the_prompt() -> None:
    assert all(cls.name == name for name, cls in POLICIES.items())
    assert {n for n, cls in POLICIES.items() if cls.needs_prompt} == {"prefix"}


def test_a_new_policy_is_one_class_and_the_picker_asks_nothing_else() -> None:
    class Last(Policy):
        name = "last"

        def select(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate:
            return candidates[-1]

    last = Last(Setup(random.Random(0)))
    assert last.choose(cands(0, 1, 2), Ask()).id == "w2"
    assert last.choose(kv((0, 900), (0, 900)), Ask(need=50, preferred="w0")).id == "w0"


def test_p2c_records_a_pick_without_room() -> None:
    before = REGISTRY.get_sample_value("meshserve_router_kv_no_room_total") or 0
    p2c = P2C(Setup(random.Random(12)))
    full = kv((0, 10), (1, 20))
    ask = Ask(need=50)
    p2c.picked(p2c.choose(full, ask), full, ask)
    roomy = kv((0, 900), (1, 20))
    p2c.picked(p2c.choose(roomy, ask), roomy, ask)
    assert REGISTRY.get_sample_value("meshserve_router_kv_no_room_total") == before + 1
