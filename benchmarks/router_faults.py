"""Fault figures of the router and the ledger: what clients saw next to what the ledger counted.

    .venv/bin/python -m benchmarks.router_faults [--out FILE.json]

Starts a private redis-server, two CPU workers (mlp, 2 ms simulated compute), a router and
a ledger (SQLite) on 127.0.0.1, runs each case bounded in count and time, and prints one
JSON object per case: what the clients saw next to what the ledger counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common import mesh_state
from devmesh.processes import Process
from devmesh.testing import Mesh, mlp_config, mlp_repository, mlp_request
from ledger.store import Store
from protos import grpc_service_pb2_grpc as pb_grpc

INFER = "/inference.GRPCInferenceService/ModelInfer"


def used_memory(r: Any) -> int:
    return int(r.info("memory")["used_memory"])


def ledger_success(store: Store) -> tuple[int, int]:
    u = store.usage()
    return (
        sum(v["success"] for v in u.values()),
        sum(v["revenue_micro_usd"] for v in u.values()),
    )


def settled(store: Store, wait_s: float = 3.0) -> tuple[int, int]:
    """The ledger's totals once they stop moving."""
    last, stable_since = ledger_success(store), time.monotonic()
    deadline = time.monotonic() + wait_s * 4
    while time.monotonic() < deadline and time.monotonic() - stable_since < wait_s:
        time.sleep(0.2)
        now = ledger_success(store)
        if now != last:
            last, stable_since = now, time.monotonic()
    return last


Call = Callable[[pb_grpc.GRPCInferenceServiceStub, int], Awaitable[None]]


async def bounded_calls(address: str, n: int, concurrency: int, one: Call) -> Counter:
    """n calls by `concurrency` callers, for 30 s at most; each call's outcome by code name."""
    codes: Counter[str] = Counter()
    it = iter(range(n))
    stop_at = time.monotonic() + 30
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def caller() -> None:
            for i in it:
                if time.monotonic() > stop_at:
                    return
                try:
                    await one(stub, i)
                    codes["OK"] += 1
                except asyncio.CancelledError:
                    codes["CANCELLED"] += 1
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return codes


async def deadlines(address: str, n: int, timeout: float, concurrency: int = 16) -> Counter:
    async def one(stub: pb_grpc.GRPCInferenceServiceStub, i: int) -> None:
        await stub.ModelInfer(mlp_request(i), timeout=timeout)

    return await bounded_calls(address, n, concurrency, one)


async def cancels(address: str, n: int, after_s: float, concurrency: int = 8) -> Counter:
    async def one(stub: pb_grpc.GRPCInferenceServiceStub, i: int) -> None:
        call = stub.ModelInfer(mlp_request(i), timeout=10)
        await asyncio.sleep(after_s)
        call.cancel()
        await call

    return await bounded_calls(address, n, concurrency, one)


async def odd_names(address: str, n: int, version: str, model: str = "mlp") -> Counter:
    codes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for i in range(n):
            request = mlp_request(i)
            request.model_name = model
            request.model_version = f"{version}{i}" if len(version) > 100 else version
            try:
                await stub.ModelInfer(request, timeout=5)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
    return codes


async def mutated(address: str, n: int, seed: int = 12) -> Counter:
    rng = random.Random(seed)
    base = mlp_request(1).SerializeToString()
    codes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        for _ in range(n):
            raw = bytearray(base)
            for _ in range(rng.randint(1, 8)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            try:
                await call(bytes(raw), timeout=5)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
    return codes


def case(name: str, **figures: Any) -> dict:
    row = {"case": name, **figures}
    print(json.dumps(row), flush=True)
    return row


@dataclass
class _Figures:
    """The mesh the cases run against; `router` is the router's address, changed by a restart."""

    mesh: Mesh
    store: Store
    workers: list[str]
    router: str
    redis: Any


def run(root: Path) -> list[dict]:
    rows = []
    mesh = Mesh(root / "logs")
    mesh.start_redis()
    try:
        m = _start(mesh, root)
        rows += _ledger_cases(m)
        rows += _odd_input_cases(m)
        rows += _load_cases(m)
        rows += _redis_cases(m)
    finally:
        mesh.stop(kill=True)
    return rows


def _start(mesh: Mesh, root: Path) -> _Figures:
    """Two workers, a router and a ledger, with a 1 s registry TTL."""
    repo = mlp_repository(root / "repo", mlp_config(simulated_us=2000, queue=4096))
    workers = [mesh.add_worker(repo, "--registry-ttl-seconds", "1") for _ in range(2)]
    mesh.wait_registered(2)
    router = mesh.start_router(
        "--router-id", "figures", "--registry-ttl-seconds", "1", "--metrics-port", "0"
    )
    store = Store(f"sqlite:///{root / 'ledger.db'}")
    mesh.start_ledger(store.url, "--interval-seconds", "0.1")
    return _Figures(mesh, store, workers, router, mesh.redis_client())


def _ledger_cases(m: _Figures) -> list[dict]:
    """Calls cut short by a deadline or a cancel, and a router restarted with the same id:
    what the clients saw next to what the ledger counted."""
    rows = []
    before = settled(m.store, 1.0)
    for name, calls in (  # 1. deadlines of 3 ms; 2. client cancel after 2 ms
        ("deadline_3ms", lambda: deadlines(m.router, 1000, 0.003)),
        ("cancel_2ms", lambda: cancels(m.router, 300, 0.002)),
    ):
        codes = asyncio.run(calls())
        after = settled(m.store)
        success, revenue = after[0] - before[0], after[1] - before[1]
        rows.append(case(name, client=dict(codes), ledger_success=success, ledger_revenue=revenue))
        before = after
    # 3. a router restarted with the same id
    ok = asyncio.run(deadlines(m.router, 300, 5.0, concurrency=4))["OK"]
    assert m.mesh.router is not None
    m.mesh.router.stop()
    m.router = m.mesh.start_router("--router-id", "figures", "--registry-ttl-seconds", "1")
    ok += asyncio.run(deadlines(m.router, 300, 5.0, concurrency=4))["OK"]
    after = settled(m.store)
    rows.append(
        case(
            "router_restart_same_id",
            client_ok=ok,
            ledger_success=after[0] - before[0],
        )
    )
    return rows


def _odd_input_cases(m: _Figures) -> list[dict]:
    """Client-chosen names far too long, and byte-mutated requests."""
    rows = []
    # 4. 1 KB client-chosen versions, and `1|success`
    mem0 = used_memory(m.redis)
    rows0 = len(m.store.usage())
    codes = asyncio.run(odd_names(m.router, 300, "v" * 1024))
    codes_pipe = asyncio.run(odd_names(m.router, 20, "1|success"))
    time.sleep(1.0)
    rows.append(
        case(
            "long_versions",
            client=dict(codes),
            pipe_version=dict(codes_pipe),
            redis_used_memory_growth_bytes=used_memory(m.redis) - mem0,
            ledger_rows_added=len(m.store.usage()) - rows0,
            ledger_keys=sorted(f"{name}|{v[:12]}" for name, v in m.store.usage())[:5],
        )
    )
    # 5. a 10 KB model name
    rows.append(
        case(
            "model_name_10kb",
            client=dict(asyncio.run(odd_names(m.router, 3, "", "m" * 10_240))),
        )
    )
    # 6. byte-mutated requests
    assert m.mesh.router is not None
    log = m.mesh.router.log
    tracebacks0 = log.read_text().count("Traceback")
    codes = asyncio.run(mutated(m.router, 300))
    rows.append(
        case(
            "mutated_requests_300",
            client=dict(codes),
            router_tracebacks=log.read_text().count("Traceback") - tracebacks0,
        )
    )
    return rows


def _load_cases(m: _Figures) -> list[dict]:
    """An open burst against the slow mesh, and a worker stopped with calls in flight."""
    rows = []
    # 7. open burst of 400 concurrent calls against a slow mesh: admission
    codes = asyncio.run(deadlines(m.router, 400, 20.0, concurrency=400))
    rows.append(case("burst_400_concurrent", client=dict(codes)))
    # 8. a worker SIGSTOPped with calls in flight
    victim = m.mesh.workers[m.workers[0]]
    loop_codes: Counter[str] = Counter()
    before = settled(m.store, 1.0)
    waited = asyncio.run(_stopped_in_flight(m.router, victim, loop_codes))
    victim.signal(signal.SIGCONT)
    after = settled(m.store)
    rows.append(
        case(
            "worker_sigstop_inflight",
            client=dict(loop_codes),
            seconds_to_last_status=round(waited, 2),
            ledger_success=after[0] - before[0],
        )
    )
    return rows


async def _stopped_in_flight(router: str, victim: Process, codes: Counter[str]) -> float:
    """16 calls, the victim SIGSTOPped 1 ms in: seconds until the last one's status."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer(mlp_request(i), timeout=20) for i in range(16)]
        await asyncio.sleep(0.001)
        victim.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        for c in calls:
            try:
                await c
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
        return time.monotonic() - t0


def _redis_cases(m: _Figures) -> list[dict]:
    """Redis back empty after an outage, and malformed or forged batches in a router's stream."""
    rows = []
    # 9. Redis back empty after an outage longer than the registry TTL (1 s)
    time.sleep(1.5)
    m.mesh.restart_redis(2.0)
    codes = asyncio.run(deadlines(m.router, 200, 5.0, concurrency=4))
    rows.append(case("redis_empty_after_ttl_outage", client=dict(codes)))
    # 10. a malformed batch in a router's stream
    r = m.mesh.redis_client()
    r.sadd(mesh_state.ROUTERS, "forged")
    r.xadd(mesh_state.calls_stream("forged"), {"usage": "{not json", "at_ms": "1"}, id="1-1")
    ledger = m.mesh.others[-1]
    time.sleep(2.0)
    rows.append(case("malformed_batch", ledger_alive=ledger.alive))
    if not ledger.alive:  # clear the way for the next case
        r.srem(mesh_state.ROUTERS, "forged")
        r.delete(mesh_state.calls_stream("forged"))
        m.mesh.start_ledger(m.store.url, "--interval-seconds", "0.1")
    # 11. a forged batch: N +7 with no call made
    before = settled(m.store, 0.5)
    r.sadd(mesh_state.ROUTERS, "forged2")
    r.xadd(
        mesh_state.calls_stream("forged2"),
        {"usage": '{"mlp|1": [7, 7, 0, 1750, 0]}', "at_ms": "1"},
        id="1-1",
    )
    after = settled(m.store, 1.0)
    rows.append(case("forged_batch", ledger_success_added=after[0] - before[0]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
