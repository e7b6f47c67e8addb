"""Registry changes pushed over Redis pub/sub: a router whose safety-net poll is 60 s away
still learns of joins, depths and leaves as they happen."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from pathlib import Path

from devmesh.processes import free_port
from devmesh.testing import Mesh, call_many, mlp_config, mlp_repository

NO_POLL = ("--poll-seconds", "60")


def replica_depths(metrics_port: int) -> dict[str, float]:
    """The router's meshserve_router_replica_depth gauge: worker id -> last depth sample."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    prefix = 'meshserve_router_replica_depth{worker="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def worker_id_of(address: str) -> str:
    return "worker-" + address.replace(":", "-")  # the default id: worker-<host>-<port>


def wait_for(condition, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_joins_depths_and_leaves_reach_the_router_without_a_poll(
    mesh: Mesh, tmp_path: Path
) -> None:
    slow = mlp_repository(tmp_path / "slow", mlp_config(simulated_us=300_000, max_batch=1))
    metrics = free_port()
    router = mesh.start_router(*NO_POLL, "--metrics-port", str(metrics))
    assert replica_depths(metrics) == {}

    # A join: the worker registers after the router's first (and, for 60 s, last) read.
    first = mesh.add_worker(slow)
    worker_id = worker_id_of(first)
    assert wait_for(lambda: worker_id in replica_depths(metrics))
    assert asyncio.run(call_many(router, 2, concurrency=1)) == {"OK": 2}

    # Depths: calls queued on the worker show in the router's view while they run...
    calls = threading.Thread(target=lambda: asyncio.run(call_many(router, 6, concurrency=6)))
    calls.start()
    assert wait_for(lambda: replica_depths(metrics).get(worker_id, 0) >= 2)
    calls.join(30)
    # ...and the worker's idle depth once they are done.
    assert wait_for(lambda: replica_depths(metrics).get(worker_id) == 0)

    # A leave: a second worker joins, the first drains and deregisters; the router stops
    # sending it calls at once (its gauge series goes), well before any poll.
    second = mesh.add_worker(slow)
    assert wait_for(lambda: worker_id_of(second) in replica_depths(metrics))
    mesh.workers.pop(first).stop()
    assert wait_for(lambda: worker_id not in replica_depths(metrics), timeout=5.0)
    assert asyncio.run(call_many(router, 4, concurrency=2)) == {"OK": 4}
