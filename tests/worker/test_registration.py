"""A worker's registration against a real redis-server: the leave is final (no heartbeat
already on its way puts the worker back), survives Redis being away for part of it, and is
bounded when Redis hangs."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from common import mesh_state
from common.mesh_state import ModelEntry, WorkerInfo
from devmesh.processes import Process, free_port, redis_process, wait_redis
from worker.registration import Registration


@dataclass
class Redis:
    server: Process
    port: int
    client: redis.Redis

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def registered(self, worker_id: str) -> bool:
        in_set = self.client.zscore(mesh_state.WORKERS, worker_id) is not None
        return in_set or bool(self.client.exists(mesh_state.worker_key(worker_id)))

    def registration(self, worker_id: str, **kw: Any) -> Registration:
        info = WorkerInfo(worker_id, "127.0.0.1:1", {"m": ModelEntry(["1"], 8)}, "cpu")
        return Registration(self.url, info, **kw)

    async def joined(self, reg: Registration) -> None:
        """Start `reg`'s loop and wait until Redis holds its registration."""
        reg.start()
        deadline = time.monotonic() + 5
        while not self.registered(reg.info.id):
            assert time.monotonic() < deadline, "never registered"
            await asyncio.sleep(0.001)


@pytest.fixture
def r(tmp_path: Path) -> Iterator[Redis]:
    port = free_port()
    server = redis_process(port, tmp_path).start()
    wait_redis(port)
    client = redis.Redis(port=port, decode_responses=True)
    try:
        yield Redis(server, port, client)
    finally:
        server.signal(signal.SIGCONT)  # should a test have stopped it
        client.close()
        server.kill()


def test_a_leave_is_not_undone_by_a_heartbeat_in_flight(r: Redis) -> None:
    """A busy worker with a heartbeat every loop: its writes are always on their way when
    the leave comes, and none of them lands after it."""

    async def join_and_leave(n: int) -> None:
        reg = r.registration(f"w{n}", depth=lambda: 1, heartbeat_s=0.0)
        await r.joined(reg)
        await asyncio.sleep(0.001 * (n % 7))  # leave at different points of a write
        await reg.deregister(within_s=2.0)

    for n in range(20):
        asyncio.run(join_and_leave(n))
    time.sleep(0.05)  # a stray write would have landed by now
    assert r.client.zcard(mesh_state.WORKERS) == 0
    assert [n for n in range(20) if r.registered(f"w{n}")] == []


def test_a_leave_waits_out_a_redis_restart(r: Redis) -> None:
    """Redis is down when the worker leaves and back within the bound: the leave is tried
    again and lands, rather than left to the registration's TTL."""
    reg = r.registration("w", depth=lambda: 0, ttl_s=60.0)

    async def run() -> None:
        await r.joined(reg)
        r.server.stop()  # SIGTERM: the append-only file keeps the registration
        restarted = threading.Timer(0.6, r.server.start)  # same port, same data
        restarted.start()
        await reg.deregister(within_s=5.0)
        restarted.join()
        wait_redis(r.port)

    asyncio.run(run())
    assert not r.registered("w")


def test_a_leave_is_bounded_when_redis_hangs(r: Redis) -> None:
    """Redis stops answering (SIGSTOP) under a busy worker: its write on the way hangs, and
    the leave still returns within its bound plus one socket timeout, not when Redis does."""
    reg = r.registration("w", depth=lambda: 1, heartbeat_s=0.0)

    async def run() -> float:
        await r.joined(reg)
        r.server.signal(signal.SIGSTOP)
        await asyncio.sleep(0.1)  # the loop's next write is now on its way, unanswered
        start = time.monotonic()
        await reg.deregister(within_s=1.0)
        return time.monotonic() - start

    took = asyncio.run(run())
    assert took < 2.5, f"the leave took {took:.1f} s"
