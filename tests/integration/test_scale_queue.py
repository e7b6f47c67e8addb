"""A real worker keeps its model's mesh-wide queue length (the key KEDA reads) exact: it
rises to the requests waiting + running and falls back to 0, and leaves with the worker."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from common import mesh_state
from devmesh.testing import Mesh, call_many, mlp_config, mlp_repository


def test_queue_length_follows_the_workers_depth(mesh: Mesh, tmp_path: Path) -> None:
    repository = mlp_repository(tmp_path / "models", mlp_config(simulated_us=400_000, max_batch=1))
    address = mesh.add_worker(repository)
    r = mesh.redis_client()
    key = mesh_state.scale_queue_key("mlp")
    assert r.llen(key) == 0

    codes = {}
    calls = threading.Thread(
        target=lambda: codes.update(asyncio.run(call_many(address, 5, 5, max_seconds=20))),
    )
    calls.start()
    seen = set()
    deadline = time.monotonic() + 10
    while calls.is_alive() and time.monotonic() < deadline:
        seen.add(int(r.llen(key)))  # type: ignore[arg-type]
        time.sleep(0.02)
    calls.join(20)
    assert codes == {"OK": 5}
    assert max(seen) == 5  # one running, four waiting, never more than there were
    deadline = time.monotonic() + 2
    while r.llen(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.llen(key) == 0

    mesh.workers.pop(address).stop()  # drains: its share leaves with it
    assert not r.exists(mesh_state.scale_replicas_key("mlp"))
