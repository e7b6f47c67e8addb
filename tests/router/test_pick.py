"""Dispatcher.pick over fake replicas: the samples it builds candidates from, the KV need it
estimates, session affinity, and the per-replica gauges the registry keeps."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from prometheus_client import REGISTRY

from common.mesh_state import DepthSample, ModelEntry, WorkerInfo, now_ms
from router.forwarding.dispatch import Dispatcher
from router.forwarding.registry import Registry
from router.forwarding.replica import Replica
from tests.router.fakes import FakeChannel

MODEL = "smollm2"


def replica(worker: str, depth: int, kv_used: int, kv_total: int = 4096) -> Replica:
    info = WorkerInfo(worker, "127.0.0.1:1", {MODEL: ModelEntry(["1"], 64)}, "CPU")
    r = Replica(info, FakeChannel())  # type: ignore[arg-type]
    r.sample = DepthSample(depth, now_ms(), kv_used, kv_total)
    return r


def dispatcher(policy: str = "p2c", **kw: Any) -> Dispatcher:
    return Dispatcher(None, None, policy, rng=random.Random(0), **kw)  # type: ignore[arg-type]


def test_a_full_cache_with_the_shorter_queue_is_not_picked() -> None:
    # a: two long generations hold 4000 of 4096 tokens; b: three short ones hold 300.
    a, b = replica("a", 2, 4000), replica("b", 3, 300)  # need = 4300 // 5 = 860
    d = dispatcher()
    assert {d.pick([a, b], MODEL).id for _ in range(50)} == {"b"}
    plain = dispatcher("p2c_depth")
    assert {plain.pick([a, b], MODEL).id for _ in range(50)} == {"a"}


def test_a_burst_before_the_next_sample_does_not_make_the_idle_replica_look_full() -> None:
    # a: one long generation holds 1010 of 1024 (so the mean reservation is 1010); b: idle.
    # Four calls sent to b since its sample still leave it the one with room.
    a, b = replica("a", 1, 1010, 1024), replica("b", 0, 0, 1024)
    t = b.sample.at_ms + 1  # type: ignore[union-attr]
    b.inflight.update({1: t, 2: t, 3: t, 4: t})
    d = dispatcher()
    assert {d.pick([a, b], MODEL).id for _ in range(20)} == {"b"}
    assert {dispatcher("p2c_depth").pick([a, b], MODEL).id for _ in range(20)} == {"a"}


def test_a_session_sticks_while_its_replica_has_room_then_moves() -> None:
    a, b = replica("a", 4, 400), replica("b", 0, 0)
    d = dispatcher()
    before = REGISTRY.get_sample_value("meshserve_router_affinity_total", {"outcome": "hit"}) or 0
    first = d.pick([a, b], MODEL, "chat-1")
    assert first.id == "b"  # new session: p2c
    a.sample = DepthSample(0, now_ms(), 0, 4096)
    b.sample = DepthSample(6, now_ms(), 600, 4096)
    assert {d.pick([a, b], MODEL, "chat-1").id for _ in range(10)} == {"b"}  # despite load
    after = REGISTRY.get_sample_value("meshserve_router_affinity_total", {"outcome": "hit"})
    assert after == before + 10
    b.sample = DepthSample(6, now_ms(), 4090, 4096)  # b filled up
    assert d.pick([a, b], MODEL, "chat-1").id == "a"
    assert d.pick([a, b], MODEL, "chat-1").id == "a"  # remembered where it moved
    assert d.pick([a], MODEL, "chat-1").id == "a"


def test_affinity_is_bounded() -> None:
    d = dispatcher(max_sessions=3)
    a = replica("a", 0, 0)
    for i in range(10):
        d.pick([a], MODEL, f"s{i}")
    assert len(d.affinity) == 3


def test_registry_publishes_each_replicas_sample_and_forgets_a_replica_that_left() -> None:
    async def run() -> None:
        registry = Registry("redis://127.0.0.1:1/0", [])
        info = WorkerInfo("kv-w1", "127.0.0.1:9", {MODEL: ModelEntry(["1"], 8)}, "CPU")
        assert registry._upsert(
            "kv-w1", info.to_json(), DepthSample(3, now_ms(), 700, 4096).encode()
        )
        labels = {"worker": "kv-w1"}
        get = REGISTRY.get_sample_value
        assert get("meshserve_router_replica_kv_used_tokens", labels) == 700
        assert get("meshserve_router_replica_kv_total_tokens", labels) == 4096
        assert get("meshserve_router_replica_depth", labels) == 3
        await registry._remove("kv-w1", "test")
        assert get("meshserve_router_replica_kv_used_tokens", labels) is None
        assert get("meshserve_router_replica_depth", labels) is None
        await registry.redis.aclose()

    asyncio.run(run())


def test_with_every_cache_full_the_pick_is_counted_and_goes_to_the_shorter_queue() -> None:
    a, b = replica("a", 3, 1000, 1024), replica("b", 1, 1000, 1024)  # need 500: no room
    get = REGISTRY.get_sample_value
    before = get("meshserve_router_kv_no_room_total") or 0
    d = dispatcher()
    assert {d.pick([a, b], MODEL).id for _ in range(5)} == {"b"}
    assert get("meshserve_router_kv_no_room_total") == before + 5
