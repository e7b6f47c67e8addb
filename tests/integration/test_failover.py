"""Redis fails over under load: real redis-server processes on 127.0.0.1 (a primary, a
replica, three sentinels), the worker, router and ledger given the Sentinel URL; the primary
is killed with -9 while 8 clients call with an API key."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import mesh_state
from common.tenancy import TenantPolicy
from devmesh.sentinel import SentinelGroup
from devmesh.testing import Mesh, call_many, mlp_config, mlp_repository
from ledger.store import Store

LOAD_S = 12.0
KILL_AT_S = 3.0


@pytest.fixture
def failover_mesh(tmp_path: Path) -> Iterator[tuple[Mesh, SentinelGroup]]:
    (tmp_path / "redis").mkdir()
    group = SentinelGroup(tmp_path / "redis").start()
    mesh = Mesh(tmp_path / "logs")
    mesh.external_redis_url = group.url
    mesh.auth = True
    try:
        mesh.add_worker(mlp_repository(tmp_path / "repo", mlp_config(max_batch=32)))
        mesh.wait_registered(1)
        mesh.start_router("--auth-cache-seconds", "0.5")
        mesh.start_ledger("", "--interval-seconds", "0.2")
        yield mesh, group
    finally:
        mesh.stop(kill=True)
        group.stop()


def ledger_successes(mesh: Mesh) -> int:
    store = Store(mesh.ledger_db)
    try:
        return store.usage().get(("mlp", "1"), {}).get("success", 0)
    finally:
        store.close()


def test_calls_keys_and_billing_survive_a_failover(
    failover_mesh: tuple[Mesh, SentinelGroup],
) -> None:
    mesh, group = failover_mesh
    admin = mesh.tenant_admin()
    # a rate limit, so the limiter's Lua script runs on each primary (the router's append
    # script runs with every batch)
    admin.set_tenant("acme", TenantPolicy(models=("mlp",), requests_per_second=100_000))
    _, key = admin.create_key("acme")
    _, fresh = admin.create_key("acme")  # first used after the failover
    codes: Counter[str] = Counter()

    def load() -> None:
        codes.update(asyncio.run(call_many(mesh.router_address, 1_000_000, 8, LOAD_S, 5.0, key)))

    caller = threading.Thread(target=load)
    caller.start()
    time.sleep(KILL_AT_S)
    old = group.kill_primary()
    killed_at = time.monotonic()
    new = group.wait_failover(old)
    failover_s = time.monotonic() - killed_at
    caller.join(LOAD_S + 30)
    assert not caller.is_alive()
    print(f"failover {failover_s:.2f} s, codes {dict(codes)}")
    assert new != old and failover_s < 15
    assert codes["OK"] > 0 and set(codes) == {"OK"}, codes  # served throughout
    deadline = time.monotonic() + 20
    while ledger_successes(mesh) < codes["OK"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ledger_successes(mesh) == codes["OK"]  # billed once each, none lost
    # keys keep working on the new primary: one the router never saw, and one made now
    after = dict(asyncio.run(call_many(mesh.router_address, 20, 2, 10.0, 5.0, fresh)))
    assert after == {"OK": 20}
    _, made_now = admin.create_key("acme")
    assert dict(asyncio.run(call_many(mesh.router_address, 5, 1, 10.0, 5.0, made_now))) == {"OK": 5}
    assert mesh.redis_client().zcard(mesh_state.WORKERS) == 1  # the worker registered there
