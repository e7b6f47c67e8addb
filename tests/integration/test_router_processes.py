"""`python -m router --processes N`: N router processes on one port, counting exactly."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import grpc

from common import mesh_state
from devmesh.processes import free_port
from devmesh.testing import Mesh, mlp_config, mlp_repository, mlp_request
from ledger.store import Store

PRICE = 250  # micro-USD, from mlp_config
CONNECTIONS = 16  # all on one of 2 processes by chance: 2 / 2**16


async def calls_over_connections(address: str, per_connection: int) -> Counter[str]:
    """`per_connection` calls on each of CONNECTIONS separate TCP connections (a local
    subchannel pool each: channels to one address otherwise share one connection)."""
    codes: Counter[str] = Counter()
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(CONNECTIONS)]

    async def caller(channel: grpc.aio.Channel) -> None:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
        )
        for i in range(per_connection):
            try:
                await infer(mlp_request(i), timeout=10)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1

    try:
        await asyncio.wait_for(asyncio.gather(*(caller(c) for c in channels)), 120)
    finally:
        for channel in channels:
            await channel.close()
    return codes


def live_calls(mesh: Mesh) -> dict[str, int]:
    """Each router's live count of mlp calls (its usage hash, written a few times a second)."""
    client = mesh.redis_client()
    field = mesh_state.usage_field("mlp", "1", "calls")
    return {
        r: int(client.hget(mesh_state.usage_key(r), field) or 0)
        for r in client.smembers(mesh_state.ROUTERS)
    }


def children_of(pid: int) -> list[int]:
    """The router processes of supervisor `pid` (not multiprocessing's resource tracker)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [
        int(p) for p in text.split() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]


def test_two_processes_share_the_port_and_count_exactly(mesh: Mesh, tmp_path: Path) -> None:
    repo = mlp_repository(tmp_path / "repo", mlp_config(max_batch=32))
    for _ in range(2):
        mesh.add_worker(repo)
    mesh.wait_registered(2)
    router = mesh.start_router("--processes", "2", "--router-id", "rp")
    assert mesh.router is not None and mesh.router.popen is not None
    supervisor = mesh.router.popen.pid
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger = mesh.start_ledger(store.url, "--interval-seconds", "0.1")

    codes = asyncio.run(calls_over_connections(router, per_connection=25))
    assert codes == {"OK": CONNECTIONS * 25}
    deadline = time.monotonic() + 5
    while sum(live_calls(mesh).values()) < CONNECTIONS * 25 and time.monotonic() < deadline:
        time.sleep(0.1)
    live = live_calls(mesh)
    assert set(live) == {"rp-0", "rp-1"} and sum(live.values()) == CONNECTIONS * 25, live
    assert min(live.values()) > 0, live  # the kernel spread the connections over both

    # One process dies (kill -9): the supervisor starts it again under the same router id;
    # the other keeps serving meanwhile.
    first, second = children_of(supervisor)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = children_of(supervisor)
        if len(alive) == 2 and first not in alive:
            break
        time.sleep(0.2)
    assert len(children_of(supervisor)) == 2 and first not in children_of(supervisor)
    assert second in children_of(supervisor)
    time.sleep(2.0)  # the new process is serving
    codes = asyncio.run(calls_over_connections(router, per_connection=10))
    assert codes == {"OK": CONNECTIONS * 10}

    mesh.router.stop()  # SIGTERM: both processes drain and write their last batch
    assert mesh.router.popen.returncode == 0
    assert mesh.redis_client().smembers(mesh_state.ROUTERS) == {"rp-0", "rp-1"}
    # Exact in the ledger: the killed process's calls were answered only once their batch
    # was in Redis (group commit), so nothing answered OK died with it.
    calls = CONNECTIONS * 35
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        u = store.usage().get(("mlp", "1"))
        if u and u["success"] >= calls:
            break
        time.sleep(0.2)
    ledger.stop()
    u = store.usage()[("mlp", "1")]
    assert (u["success"], u["errors"], u["revenue_micro_usd"]) == (calls, 0, calls * PRICE)


def test_processes_need_a_fixed_port(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "router", "--processes", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--processes 2 needs a fixed --port" in result.stderr


def test_a_taken_port_stops_the_router(mesh: Mesh) -> None:
    """A port another program holds (without SO_REUSEPORT) is not shared: the processes fail
    before they serve and the supervisor exits instead of restarting them in a loop."""
    import socket

    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        mesh.router = None
        from devmesh.processes import router_process

        process = router_process(port, mesh.redis_url, mesh.log_dir, "--processes", "2").start()
        assert process.popen is not None
        assert process.popen.wait(60) == 1
