"""The router in a real mesh: private redis-server, worker processes, router process."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from common import mesh_state
from common.mesh_state import WorkerInfo
from devmesh.testing import (
    Mesh,
    call_many,
    mlp_config,
    mlp_repository,
    worker_successes,
)
from router.money.accounting import read_usage


def repo(tmp_path: Path, name: str, **config: int) -> Path:
    return mlp_repository(tmp_path / name, mlp_config(**config))


def usage_total(mesh: Mesh) -> dict:
    import redis.asyncio as aioredis

    async def read() -> dict:
        client = aioredis.Redis(port=mesh.redis_port, decode_responses=True)
        try:
            return await read_usage(client)
        finally:
            await client.aclose()

    return asyncio.run(read())


def wait_usage(mesh: Mesh, calls: int, timeout: float = 5.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        usage = usage_total(mesh).get(("mlp", "1"))
        if (usage is not None and usage.calls == calls) or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


def test_registration_heartbeat_and_ttl(mesh: Mesh, tmp_path: Path) -> None:
    address = mesh.add_worker(repo(tmp_path, "r"), "--registry-ttl-seconds", "1")
    client = mesh.redis_client()
    (worker_id,) = client.zrange(mesh_state.WORKERS, 0, -1)
    info = WorkerInfo.from_json(client.get(mesh_state.worker_key(worker_id)))
    assert info.address == address
    assert info.provider == "CPUExecutionProvider"
    assert info.models["mlp"].versions == ["1"]
    assert info.models["mlp"].max_queue == 128
    assert info.models["mlp"].price_micro_usd == 250
    depth = mesh_state.DepthSample.decode(client.get(mesh_state.depth_key(worker_id)))
    assert depth.depth == 0 and abs(depth.at_ms - time.time() * 1000) < 2000
    # Heartbeats keep the 1 s TTL alive...
    time.sleep(1.5)
    assert client.exists(mesh_state.worker_key(worker_id))
    # ...until the worker dies without a word: then the entry expires by itself.
    mesh.workers[address].kill()
    time.sleep(1.5)
    assert not client.exists(mesh_state.worker_key(worker_id))


def test_drain_deregisters_at_once(mesh: Mesh, tmp_path: Path) -> None:
    address = mesh.add_worker(repo(tmp_path, "r"))
    client = mesh.redis_client()
    assert client.zcard(mesh_state.WORKERS) == 1
    assert mesh.workers[address].stop() == 0
    assert client.zcard(mesh_state.WORKERS) == 0
    assert client.keys("meshserve:worker:*") == []


def test_equal_workers_share_evenly(mesh: Mesh, tmp_path: Path) -> None:
    r = repo(tmp_path, "r", simulated_us=1000)
    workers = [mesh.add_worker(r), mesh.add_worker(r)]
    mesh.wait_registered(2)
    router = mesh.start_router()
    codes = asyncio.run(call_many(router, 1000, concurrency=8))
    assert codes == {"OK": 1000}
    shares = [worker_successes(w) / 1000 for w in workers]
    assert all(0.4 <= s <= 0.6 for s in shares), shares


def test_p2c_sends_fewer_calls_to_a_slow_worker(mesh: Mesh, tmp_path: Path) -> None:
    fast = mesh.add_worker(repo(tmp_path, "fast", simulated_us=1000, max_batch=1))
    slow = mesh.add_worker(repo(tmp_path, "slow", simulated_us=20000, max_batch=1))
    mesh.wait_registered(2)
    router = mesh.start_router("--policy", "p2c")
    codes = asyncio.run(call_many(router, 400, concurrency=8))
    assert codes == {"OK": 400}
    slow_share = worker_successes(slow) / 400
    assert slow_share < 0.25, (slow_share, worker_successes(fast))


def test_kill_9_of_a_worker_loses_no_call(mesh: Mesh, tmp_path: Path) -> None:
    r = repo(tmp_path, "r", simulated_us=2000)
    victim, _ = mesh.add_worker(r), mesh.add_worker(r)
    mesh.wait_registered(2)
    router = mesh.start_router()
    killer = threading.Timer(1.0, mesh.workers[victim].kill)
    killer.start()
    codes = asyncio.run(call_many(router, 1500, concurrency=8, max_seconds=30))
    killer.join()
    assert not mesh.workers[victim].alive
    assert set(codes) == {"OK"}, codes
    assert codes["OK"] > 0
    assert "replica_ejected" in mesh.router.log.read_text()  # type: ignore[union-attr]


def test_redis_restart_keeps_serving_and_counts_exactly(mesh: Mesh, tmp_path: Path) -> None:
    r = repo(tmp_path, "r", simulated_us=1000)
    mesh.add_worker(r)
    mesh.add_worker(r)
    mesh.wait_registered(2)
    router = mesh.start_router()

    bouncer = threading.Timer(0.8, mesh.restart_redis, (1.0,))
    bouncer.start()
    codes = asyncio.run(call_many(router, 1200, concurrency=8, max_seconds=30))
    bouncer.join()
    assert set(codes) == {"OK"}, codes
    usage = wait_usage(mesh, codes["OK"])
    assert usage is not None
    assert (usage.calls, usage.success, usage.errors) == (codes["OK"], codes["OK"], 0)
    assert usage.revenue_micro_usd == codes["OK"] * 250


def test_overload_is_resource_exhausted(mesh: Mesh, tmp_path: Path) -> None:
    mesh.add_worker(repo(tmp_path, "r", simulated_us=100_000, max_batch=1, queue=4))
    mesh.wait_registered(1)
    router = mesh.start_router()
    codes = asyncio.run(call_many(router, 30, concurrency=30, timeout=20))
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes["RESOURCE_EXHAUSTED"] >= 20
    usage = wait_usage(mesh, 30)
    assert usage is not None
    assert (usage.calls, usage.success, usage.errors) == (
        30,
        codes["OK"],
        codes["RESOURCE_EXHAUSTED"],
    )


def test_tritonclient_through_the_router(mesh: Mesh, tmp_path: Path) -> None:
    r = repo(tmp_path, "r")
    mesh.add_worker(r)
    mesh.add_worker(r)
    mesh.wait_registered(2)
    client = triton.InferenceServerClient(mesh.start_router())
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and not client.is_model_ready("nope")
    assert client.get_server_metadata().name == "meshserve-router"
    assert [t.name for t in client.get_model_metadata("mlp").inputs] == ["INPUT0"]
    assert client.get_model_config("mlp").config.max_batch_size == 8
    assert [(m.name, m.version) for m in client.get_model_repository_index().models] == [
        ("mlp", "1")
    ]

    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    i = triton.InferInput("INPUT0", [2, 16], "FP32")
    i.set_data_from_numpy(x)
    direct = triton.InferenceServerClient(next(iter(mesh.workers))).infer("mlp", [i])
    for n in range(10):
        result = client.infer("mlp", [i], request_id=f"id-{n}")
        assert result.get_response().id == f"id-{n}"
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), direct.as_numpy("OUTPUT0"))
    stats = client.get_inference_statistics("mlp").model_stats
    assert len(stats) == 1 and stats[0].inference_stats.success.count == 11  # summed

    bad = triton.InferInput("INPUT0", [2, 15], "FP32")
    bad.set_data_from_numpy(np.ones((2, 15), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("mlp", [bad])
    assert str(info.value.status()) == "StatusCode.INVALID_ARGUMENT"
    assert "shape [2, 15] does not fit" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [i])
    assert str(info.value.status()) == "StatusCode.NOT_FOUND"
    router_log = mesh.router.log.read_text()  # type: ignore[union-attr]
    assert "retrying" not in router_log  # INVALID_ARGUMENT is never retried


def test_router_sees_workers_join_and_leave(mesh: Mesh, tmp_path: Path) -> None:
    r = repo(tmp_path, "r")
    first = mesh.add_worker(r)
    mesh.wait_registered(1)
    router = mesh.start_router()
    second = mesh.add_worker(r)
    mesh.wait_registered(2)
    asyncio.run(call_many(router, 200, concurrency=4))
    assert worker_successes(second) > 0  # joined without a router restart
    mesh.workers[first].signal(signal.SIGTERM)  # drains and leaves
    mesh.workers[first].popen.wait(20)  # type: ignore[union-attr]
    before = worker_successes(second)
    codes = asyncio.run(call_many(router, 100, concurrency=4))
    assert codes == {"OK": 100}
    assert worker_successes(second) == before + 100


def test_prometheus_metrics(mesh: Mesh, tmp_path: Path) -> None:
    import urllib.request

    from devmesh.processes import free_port

    mesh.add_worker(repo(tmp_path, "r"))
    mesh.wait_registered(1)
    port = free_port()
    router = mesh.start_router("--metrics-port", str(port))
    assert asyncio.run(call_many(router, 20, concurrency=2)) == {"OK": 20}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert 'meshserve_router_requests_total{code="OK",model="mlp"} 20.0' in text
    assert 'meshserve_router_latency_seconds_count{part="router"} 20.0' in text
    assert 'meshserve_router_latency_seconds_count{part="upstream"} 20.0' in text
    assert "meshserve_router_inflight{" in text


def test_deadline_reaches_the_worker(mesh: Mesh, tmp_path: Path) -> None:
    mesh.add_worker(repo(tmp_path, "r", simulated_us=2_000_000, max_batch=1))
    mesh.wait_registered(1)
    router = mesh.start_router()
    started = time.monotonic()
    codes = asyncio.run(call_many(router, 1, concurrency=1, timeout=0.3))
    assert codes == {"DEADLINE_EXCEEDED": 1}
    assert time.monotonic() - started < 1.5  # the caller's deadline, not the model's 2 s


def test_stream_infer_through_the_router(mesh: Mesh, tmp_path: Path) -> None:
    import tritonclient.grpc.aio as triton_aio

    r = repo(tmp_path, "r")
    mesh.add_worker(r)
    mesh.add_worker(r)
    mesh.wait_registered(2)
    router = mesh.start_router()

    async def run() -> list[str]:
        client = triton_aio.InferenceServerClient(router)

        async def requests():  # type: ignore[no-untyped-def]
            for i in range(6):
                x = triton.InferInput("INPUT0", [1, 16], "FP32")
                x.set_data_from_numpy(np.full((1, 16), i, np.float32))
                yield {
                    "model_name": "nope" if i == 5 else "mlp",
                    "inputs": [x],
                    "request_id": str(i),
                }

        got = []
        async for result, error in client.stream_infer(requests(), stream_timeout=20):
            got.append(result.get_response().id if error is None else f"error:{error}")
        await client.close()
        return got

    got = asyncio.run(run())
    assert sorted(g for g in got if not g.startswith("error")) == ["0", "1", "2", "3", "4"]
    assert any("no replica serves model 'nope'" in g for g in got)
