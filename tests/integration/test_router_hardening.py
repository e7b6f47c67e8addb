"""The router against stopped workers, an emptied Redis, forged registrations and odd
client input: real redis-server, worker and router processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from common import mesh_state
from devmesh.processes import free_port
from devmesh.testing import Mesh, call_many, mlp_config, mlp_repository, mlp_request
from protos import grpc_service_pb2_grpc as pb_grpc
from router.money.accounting import read_usage

PRICE = 250  # micro-USD, from mlp_config
INFER = "/inference.GRPCInferenceService/ModelInfer"


def usage(mesh: Mesh) -> dict:
    import redis.asyncio as aioredis

    async def read() -> dict:
        client = aioredis.Redis(port=mesh.redis_port, decode_responses=True)
        try:
            return await read_usage(client)
        finally:
            await client.aclose()

    return asyncio.run(read())


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def codes_of(address: str, requests: list) -> list[tuple[str, str]]:
    """(status name, details) of each request, sent one after the other."""
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for request in requests:
            try:
                await stub.ModelInfer(request, timeout=5)
                out.append(("OK", ""))
            except grpc.aio.AioRpcError as e:
                out.append((e.code().name, e.details() or ""))
    return out


def test_calls_to_a_stopped_worker_get_a_status_soon_and_are_not_billed(
    mesh: Mesh, tmp_path: Path
) -> None:
    repo = mlp_repository(tmp_path / "r", mlp_config(simulated_us=300_000, max_batch=8))
    victim = mesh.add_worker(repo)
    mesh.add_worker(repo)
    mesh.wait_registered(2)
    router = mesh.start_router()  # the registry TTL is 5 s: the stall probe must act first
    seen: dict[str, int] = {}

    async def run() -> float:
        async with grpc.aio.insecure_channel(router) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            calls = [stub.ModelInfer(mlp_request(i), timeout=30) for i in range(16)]
            await asyncio.sleep(0.1)  # every call is at a worker now
            mesh.workers[victim].signal(signal.SIGSTOP)
            stopped = time.monotonic()
            for call in calls:
                try:
                    await call
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                seen[code] = seen.get(code, 0) + 1
            return time.monotonic() - stopped

    try:
        waited = asyncio.run(run())
    finally:
        mesh.workers[victim].signal(signal.SIGCONT)
    # Every call got its status within a few seconds, not at its 30 s deadline nor after
    # the 5 s registry TTL: the stopped worker's calls were retried on the other one (or
    # answered UNAVAILABLE).
    assert waited < 4.5, (waited, seen)
    assert set(seen) <= {"OK", "UNAVAILABLE"} and sum(seen.values()) == 16, seen
    assert "stalled" in mesh.router.log.read_text()  # type: ignore[union-attr]
    # Billed: the successes the client saw, no more (the stopped worker's answers, if it
    # ever gives them, go to cancelled calls).
    assert wait_for(lambda: usage(mesh).get(("mlp", "1")) is not None)
    time.sleep(0.5)
    u = usage(mesh)[("mlp", "1")]
    assert (u.success, u.revenue_micro_usd) == (seen.get("OK", 0), seen.get("OK", 0) * PRICE)


def test_redis_back_empty_after_an_outage_longer_than_the_ttl_keeps_the_mesh(
    mesh: Mesh, tmp_path: Path
) -> None:
    repo = mlp_repository(tmp_path / "r", mlp_config())
    for _ in range(2):
        mesh.add_worker(repo, "--registry-ttl-seconds", "1", "--heartbeat-seconds", "0.5")
    mesh.wait_registered(2)
    router = mesh.start_router("--registry-ttl-seconds", "1")
    assert asyncio.run(call_many(router, 20, concurrency=2)) == {"OK": 20}
    mesh.restart_redis(2.5)  # down for 2.5 TTLs, back with nothing in it
    codes = asyncio.run(call_many(router, 200, concurrency=4, max_seconds=30))
    assert codes == {"OK": 200}, codes
    # ...and the workers are back in the registry at once, not at their next heartbeat.
    assert wait_for(lambda: mesh.redis_client().zcard(mesh_state.WORKERS) == 2, timeout=1.0)


def test_registrations_are_checked_before_the_router_uses_them(mesh: Mesh, tmp_path: Path) -> None:
    real = mesh.add_worker(mlp_repository(tmp_path / "r", mlp_config()))
    mesh.wait_registered(1)
    router = mesh.start_router()
    r = mesh.redis_client()
    (real_id,) = r.zrange(mesh_state.WORKERS, 0, -1)
    good = json.loads(r.get(mesh_state.worker_key(real_id)))

    def plant(worker_id: str, text: str) -> None:
        r.set(mesh_state.worker_key(worker_id), text, px=30_000)
        r.zadd(mesh_state.WORKERS, {worker_id: mesh_state.now_ms() + 20_000})

    # A replica of the same model at price 0 (the address is the real worker's, so calls to
    # it would succeed: only the check keeps them from being billed at 0).
    cheap = {**good, "id": "cheap", "started_ms": 1}
    cheap["models"] = {"mlp": {**good["models"]["mlp"], "price_micro_usd": 0}}
    plant("cheap", json.dumps(cheap))
    plant("junk", "{not json")
    plant("negative", json.dumps({**good, "id": "negative", "tp": -3}))
    # A field this version does not know is tolerated: a newer worker may add one.
    plant("newer", json.dumps({**good, "id": "newer", "started_ms": 2, "zone": "eu-1"}))
    time.sleep(0.5)  # a few registry polls
    codes = asyncio.run(call_many(router, 100, concurrency=4))
    assert codes == {"OK": 100}, codes
    time.sleep(0.5)
    u = usage(mesh)[("mlp", "1")]
    assert (u.success, u.revenue_micro_usd) == (100, 100 * PRICE)
    log = mesh.router.log.read_text()  # type: ignore[union-attr]
    assert log.count("registration_refused") == 3, log[-3000:]
    assert "Traceback" not in log
    assert real


def test_client_strings_are_checked_before_they_become_keys_or_labels(
    mesh: Mesh, tmp_path: Path
) -> None:
    mesh.add_worker(mlp_repository(tmp_path / "r", mlp_config()))
    mesh.wait_registered(1)
    metrics_port = free_port()
    router = mesh.start_router("--metrics-port", str(metrics_port))
    requests = []
    for i in range(60):
        request = mlp_request(i)
        request.model_version = f"{i}-" + "v" * 1024
        requests.append(request)
    for version in ("1|success", "1|success|calls"):
        request = mlp_request(0)
        request.model_version = version
        requests.append(request)
    for i in range(30):
        request = mlp_request(i)
        request.model_name = f"nope-{i}"
        requests.append(request)
    huge = mlp_request(0)
    huge.model_name = "m" * 10_240
    requests.append(huge)
    got = asyncio.run(codes_of(router, requests))
    assert {code for code, _ in got} == {"NOT_FOUND"}, got[:3]
    assert max(len(details) for _, details in got) < 600
    assert "(10240 chars)" in got[-1][1]

    # A client string becomes a key, a row or a label only when the mesh serves it.
    assert asyncio.run(call_many(router, 5, concurrency=1)) == {"OK": 5}
    assert wait_for(lambda: ("mlp", "1") in usage(mesh))
    assert set(usage(mesh)) == {("mlp", "1"), ("mlp", "_unknown_")}
    assert usage(mesh)[("mlp", "_unknown_")].errors == 62
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        lines = [
            line
            for line in reply.read().decode().splitlines()
            if line.startswith("meshserve_router_requests_total")
        ]
    assert sorted(lines) == [
        'meshserve_router_requests_total{code="NOT_FOUND",model="_unknown_"} 31.0',
        'meshserve_router_requests_total{code="NOT_FOUND",model="mlp"} 62.0',
        'meshserve_router_requests_total{code="OK",model="mlp"} 5.0',
    ]


def test_a_request_that_does_not_parse_is_invalid_argument_without_a_traceback(
    mesh: Mesh, tmp_path: Path
) -> None:
    mesh.add_worker(mlp_repository(tmp_path / "r", mlp_config()))
    mesh.wait_registered(1)
    router = mesh.start_router()
    valid = mlp_request(1).SerializeToString()
    broken = [
        b"\xff" * 40,  # not protobuf at all
        b"\x0a\x80",  # model_name, a length past the end
        b"\x0a\x02\xc3\x28",  # model_name, not UTF-8
        valid[:-3] + b"\x0a\xff\xff\xff\xff\x0f",  # a truncated trailing field
    ]

    async def send() -> list[tuple[str, str]]:
        out = []
        async with grpc.aio.insecure_channel(router) as channel:
            call = channel.unary_unary(INFER)
            for raw in broken:
                try:
                    await call(raw, timeout=5)
                    out.append(("OK", ""))
                except grpc.aio.AioRpcError as e:
                    out.append((e.code().name, e.details() or ""))
        return out

    got = asyncio.run(send())
    assert [code for code, _ in got] == ["INVALID_ARGUMENT"] * len(broken), got
    assert all("does not parse as a ModelInferRequest" in details for _, details in got)
    log = mesh.router.log.read_text()  # type: ignore[union-attr]
    assert "Traceback" not in log and "internal_error" not in log


def test_the_router_admits_a_bounded_number_of_calls(mesh: Mesh, tmp_path: Path) -> None:
    repo = mlp_repository(tmp_path / "r", mlp_config(simulated_us=300_000, max_batch=1, queue=1000))
    mesh.add_worker(repo)
    mesh.wait_registered(1)
    router = mesh.start_router("--max-inflight", "6", "--max-inflight-per-model", "3")
    started = time.monotonic()
    codes = asyncio.run(call_many(router, 30, concurrency=30, timeout=20))
    # Three at a time reach the worker (one model); every other call is refused at once.
    assert codes["RESOURCE_EXHAUSTED"] >= 24 and codes["OK"] >= 3, codes
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("mode", ["unavailable"])
def test_a_slow_redis_never_leaves_an_answered_call_unrecorded(
    mesh: Mesh, tmp_path: Path, mode: str
) -> None:
    """--accounting-when-slow unavailable: with Redis frozen, a success cannot be recorded in
    time, so it is answered UNAVAILABLE and not billed; the client never holds an OK that
    Redis does not have."""
    mesh.add_worker(mlp_repository(tmp_path / "r", mlp_config()))
    mesh.wait_registered(1)
    router = mesh.start_router("--accounting-when-slow", mode, "--accounting-wait-seconds", "0.2")
    assert asyncio.run(call_many(router, 10, concurrency=1)) == {"OK": 10}
    assert mesh.redis_server is not None
    mesh.redis_server.signal(signal.SIGSTOP)  # Redis hangs: no error, no answer
    thaw = threading.Timer(3.0, mesh.redis_server.signal, (signal.SIGCONT,))
    thaw.start()
    try:
        codes = asyncio.run(call_many(router, 10, concurrency=2, timeout=5))
    finally:
        thaw.join()
    assert codes == {"UNAVAILABLE": 10}, codes
    assert wait_for(lambda: usage(mesh).get(("mlp", "1")) is not None)
    time.sleep(1.0)
    u = usage(mesh)[("mlp", "1")]
    assert (u.calls, u.success, u.errors, u.revenue_micro_usd) == (20, 10, 10, 10 * PRICE)
