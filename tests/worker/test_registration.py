"""A worker's registration against a real redis-server: the leave is final (no heartbeat
already on its way puts the worker back) and survives Redis being away for part of it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import redis

from common import mesh_state
from common.mesh_state import ModelEntry, WorkerInfo
from devmesh.processes import free_port, redis_process, wait_redis
from worker.registration import Registration


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "127.0.0.1:1", {"m": ModelEntry(["1"], 8)}, "CPUExecutionProvider")


def registered(client: redis.Redis, worker_id: str) -> bool:
    in_set = client.zscore(mesh_state.WORKERS, worker_id) is not None
    return in_set or bool(client.exists(mesh_state.worker_key(worker_id)))


def test_a_leave_is_not_undone_by_a_heartbeat_in_flight(tmp_path: Path) -> None:
    """A busy worker with a heartbeat every loop: its writes are always on their way when
    the leave comes, and none of them lands after it."""
    port = free_port()
    server = redis_process(port, tmp_path).start()
    try:
        wait_redis(port)
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis(port=port, decode_responses=True)

        async def join_and_leave(n: int) -> None:
            reg = Registration(url, info(f"w{n}"), depth=lambda: 1, heartbeat_s=0.0)
            reg.start()
            deadline = time.monotonic() + 5
            while not registered(client, f"w{n}"):
                assert time.monotonic() < deadline, "never registered"
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.001 * (n % 7))  # leave at different points of a write
            await reg.deregister()

        for n in range(20):
            asyncio.run(join_and_leave(n))
        time.sleep(0.05)  # a stray write would have landed by now
        assert client.zcard(mesh_state.WORKERS) == 0
        assert [n for n in range(20) if registered(client, f"w{n}")] == []
        client.close()
    finally:
        server.kill()


def test_a_leave_waits_out_a_redis_restart(tmp_path: Path) -> None:
    """Redis is down when the worker leaves and back within the bound: the leave is tried
    again and lands, rather than left to the registration's TTL."""
    port = free_port()
    server = redis_process(port, tmp_path).start()
    wait_redis(port)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis(port=port, decode_responses=True)
    reg = Registration(url, info("w"), depth=lambda: 0, ttl_s=60.0)

    async def run() -> None:
        reg.start()
        deadline = time.monotonic() + 5
        while not registered(client, "w"):
            assert time.monotonic() < deadline, "never registered"
            await asyncio.sleep(0.01)
        server.stop()  # SIGTERM: the append-only file keeps the registration
        restarted = threading.Timer(0.6, server.start)  # same port, same data
        restarted.start()
        await reg.deregister(within_s=5.0)
        restarted.join()
        wait_redis(port)

    try:
        asyncio.run(run())
        assert not registered(client, "w")
    finally:
        client.close()
        server.kill()


def test_a_leave_is_bounded_when_redis_hangs(tmp_path: Path) -> None:
    """Redis stops answering (SIGSTOP) under a busy worker: its write on the way hangs, and
    the leave still returns within its bound plus one socket timeout, not when Redis does."""
    port = free_port()
    server = redis_process(port, tmp_path).start()
    wait_redis(port)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis(port=port, decode_responses=True)
    reg = Registration(url, info("w"), depth=lambda: 1, heartbeat_s=0.0)

    async def run() -> float:
        reg.start()
        deadline = time.monotonic() + 5
        while not registered(client, "w"):
            assert time.monotonic() < deadline, "never registered"
            await asyncio.sleep(0.01)
        server.signal(signal.SIGSTOP)
        await asyncio.sleep(0.1)  # the loop's next write is now on its way, unanswered
        start = time.monotonic()
        await reg.deregister(within_s=1.0)
        return time.monotonic() - start

    try:
        took = asyncio.run(run())
        assert took < 2.5, f"the leave took {took:.1f} s"
    finally:
        server.signal(signal.SIGCONT)
        client.close()
        server.kill()
