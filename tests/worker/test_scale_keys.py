"""The mesh-wide scaling keys (worker/scaling.py) against a real redis-server: the list
lengths KEDA reads are the exact sums of the live replicas' shares, and expire."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from common import mesh_state
from devmesh.processes import free_port, redis_process, wait_redis
from worker.scaling import ModelLoad, ScaleKeys, model_loads


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    server = redis_process(port, tmp_path_factory.mktemp("redis")).start()
    wait_redis(port)
    yield f"redis://127.0.0.1:{port}/0"
    server.kill()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


def lengths(r: redis.Redis, model: str) -> tuple[int, int]:
    queue = r.llen(mesh_state.scale_queue_key(model))
    kv = r.llen(mesh_state.scale_kv_key(model))
    return int(queue), int(kv)  # type: ignore[arg-type]


async def publish(redis_url: str, worker: str, loads: dict[str, ModelLoad], ttl_ms: int) -> None:
    client = aioredis.from_url(redis_url)
    try:
        await ScaleKeys(client, worker, ttl_ms).publish(loads)
    finally:
        await client.aclose()


async def withdraw(redis_url: str, worker: str, models: list[str]) -> None:
    client = aioredis.from_url(redis_url)
    try:
        await ScaleKeys(client, worker, 5000).withdraw(models)
    finally:
        await client.aclose()


def test_lengths_are_the_sums_over_replicas(redis_url: str, r: redis.Redis) -> None:
    asyncio.run(publish(redis_url, "w1", {"mlp": ModelLoad(3), "llm": ModelLoad(2, 50, 100)}, 5000))
    asyncio.run(publish(redis_url, "w2", {"mlp": ModelLoad(4), "llm": ModelLoad(1, 30, 99)}, 5000))
    assert lengths(r, "mlp") == (7, 0)  # no KV cache: no kv list
    assert lengths(r, "llm") == (3, 50 + 30)  # 30/99 -> 30%, rounded down
    assert not r.exists(mesh_state.scale_kv_key("mlp"))
    # A replica's new share replaces its old one: shrink and grow, exactly.
    asyncio.run(publish(redis_url, "w1", {"mlp": ModelLoad(0)}, 5000))
    assert lengths(r, "mlp") == (4, 0)
    asyncio.run(publish(redis_url, "w2", {"mlp": ModelLoad(2500)}, 5000))
    assert lengths(r, "mlp") == (2500, 0)
    asyncio.run(publish(redis_url, "w2", {"mlp": ModelLoad(1)}, 5000))
    assert lengths(r, "mlp") == (1, 0)
    for key in (mesh_state.scale_queue_key("mlp"), mesh_state.scale_replicas_key("mlp")):
        assert 0 < int(r.pttl(key)) <= 5000  # type: ignore[arg-type]


def test_a_leaving_replica_is_subtracted_and_the_last_empties_the_keys(
    redis_url: str, r: redis.Redis
) -> None:
    asyncio.run(publish(redis_url, "w1", {"llm": ModelLoad(2, 80, 100)}, 5000))
    asyncio.run(publish(redis_url, "w2", {"llm": ModelLoad(5, 10, 100)}, 5000))
    asyncio.run(withdraw(redis_url, "w1", ["llm"]))
    assert lengths(r, "llm") == (5, 10)
    asyncio.run(withdraw(redis_url, "w2", ["llm"]))
    assert lengths(r, "llm") == (0, 0)
    assert not r.exists(mesh_state.scale_replicas_key("llm"))


def test_a_dead_replicas_share_is_dropped_and_the_keys_expire(
    redis_url: str, r: redis.Redis
) -> None:
    ttl_ms = 300
    asyncio.run(publish(redis_url, "dead", {"mlp": ModelLoad(6)}, ttl_ms))
    asyncio.run(publish(redis_url, "live", {"mlp": ModelLoad(1)}, ttl_ms))
    assert lengths(r, "mlp") == (7, 0)
    time.sleep(0.2)
    asyncio.run(publish(redis_url, "live", {"mlp": ModelLoad(1)}, ttl_ms))
    time.sleep(0.2)  # "dead" wrote 0.4 s ago: past the TTL; "live" 0.2 s ago
    asyncio.run(publish(redis_url, "live", {"mlp": ModelLoad(2)}, ttl_ms))
    assert lengths(r, "mlp") == (2, 0)
    assert set(r.hkeys(mesh_state.scale_replicas_key("mlp"))) == {"live"}  # type: ignore[arg-type]
    time.sleep(0.45)  # nobody writes: every key is gone, KEDA reads 0
    assert lengths(r, "mlp") == (0, 0)
    assert not r.exists(mesh_state.scale_replicas_key("mlp"))


def test_model_loads_sum_a_models_versions() -> None:
    loads = model_loads({"a": [(1, 10, 100), (2, 20, 100)], "b": [(0, 0, 0)]})
    assert loads == {"a": ModelLoad(3, 30, 200), "b": ModelLoad(0, 0, 0)}
    assert loads["a"].kv_percent == 15 and loads["b"].kv_percent == 0


def test_scaling_keys_are_documented_with_the_others() -> None:
    doc = mesh_state.__doc__ or ""
    for key in ("scale:{model}:queue", "scale:{model}:kv", "scale:{model}:replicas"):
        assert f"meshserve:{key}" in doc
    assert mesh_state.scale_queue_key("mlp") == "meshserve:scale:mlp:queue"
