"""State that survives Redis: real redis-server processes killed with -9 and restarted (empty,
from their append-only file, or from an old one), a real router asking for API keys, a real
ledger that refills Redis from its database (docs/state.md)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common import mesh_state, redis_conn
from common.tenancy import TenantPolicy, key_hash
from common.tenant_directory import TenantDirectory
from devmesh.redis_acl import make_users
from devmesh.testing import Mesh, call_many, mlp_config, mlp_repository
from ledger.restarts import RestartLog
from ledger.store import Store, utc_month
from router.tenancy.keys import TenantAdmin

PRICE = 250  # micro-USD per mlp call (mlp_config)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def ledger_successes(mesh: Mesh) -> int:
    store = Store(mesh.ledger_db)
    try:
        return store.usage().get(("mlp", "1"), {}).get("success", 0)
    finally:
        store.close()


def refilled(mesh: Mesh) -> bool:
    store = Store(mesh.ledger_db)
    try:
        want = TenantDirectory(store).version()
    finally:
        store.close()
    return mesh.redis_client().get(mesh_state.TENANTS_VERSION) == str(want)


def keyed_calls(mesh: Mesh, key: str, n: int, concurrency: int = 4) -> dict[str, int]:
    return dict(asyncio.run(call_many(mesh.router_address, n, concurrency, 30.0, 5.0, key)))


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Mesh]:
    """Redis with ACL users per role (the ledger refills as its own user), a router asking
    for keys, a ledger passing every 0.2 s that compares everything every second."""
    mesh = Mesh(tmp_path / "logs")
    mesh.users = make_users(tmp_path / "secrets")
    mesh.auth = True
    mesh.start_redis()
    try:
        mesh.add_worker(mlp_repository(tmp_path / "repo", mlp_config(max_batch=32)))
        mesh.wait_registered(1)
        mesh.start_router("--auth-cache-seconds", "0.2")
        mesh.start_ledger("", "--interval-seconds", "0.2", "--tenants-reconcile-seconds", "1")
        yield mesh
    finally:
        mesh.stop(kill=True)


def test_keyed_calls_keep_working_after_an_empty_restart(keyed: Mesh) -> None:
    admin = keyed.tenant_admin()
    admin.set_tenant("acme", TenantPolicy(models=("mlp",), requests_per_second=5000))
    _, used = admin.create_key("acme")
    _, unused = admin.create_key("acme")  # never seen by the router before the restart
    gone_id, gone = admin.create_key("acme")
    assert admin.revoke("acme", gone_id)
    assert keyed_calls(keyed, used, 40) == {"OK": 40}
    wait_for(lambda: ledger_successes(keyed) == 40, 10, "the ledger counted the 40 calls")

    keyed.restart_redis(1.0)  # kill -9, its AOF removed: back with nothing
    assert keyed.redis_client().dbsize() < 10  # empty but for what the mesh wrote since
    # served throughout: never an unknown key (the router's cache, then the refill)
    assert keyed_calls(keyed, used, 200) == {"OK": 200}
    wait_for(lambda: refilled(keyed), 10, "the ledger refilled Redis from its database")
    assert keyed_calls(keyed, unused, 20) == {"OK": 20}
    assert keyed_calls(keyed, gone, 3) == {"UNAUTHENTICATED": 3}
    # this month's spend is back (at least what the ledger had counted), for the spend cap
    spend = keyed.redis_client().get(mesh_state.spend_key("acme", utc_month(mesh_state.now_ms())))
    assert spend is not None and int(spend) >= 40 * PRICE
    # the report says that Redis restarted, and what a crash of its host could have lost
    store = Store(keyed.ledger_db)
    try:
        (notice,) = RestartLog(store, 0.2).notices()
    finally:
        store.close()
    bound = int(notice.split("up to ")[1].split(" calls")[0])
    assert "no AOF" not in notice and bound >= 1, notice


def test_a_key_revoked_never_comes_back_from_an_old_aof(keyed: Mesh) -> None:
    admin = keyed.tenant_admin()
    admin.set_tenant("acme", TenantPolicy(models=("mlp",)))
    key_id, key = admin.create_key("acme")
    _, kept = admin.create_key("acme")
    assert keyed_calls(keyed, key, 5) == {"OK": 5}
    assert keyed_calls(keyed, kept, 5) == {"OK": 5}
    time.sleep(1.2)  # appendfsync everysec: the key is in the file
    old_aof = keyed.log_dir / "old.aof"
    shutil.copy(keyed.redis_dir / "appendonly.aof", old_aof)
    assert admin.revoke("acme", key_id)
    time.sleep(0.3)  # the router's cache (0.2 s)
    assert keyed_calls(keyed, key, 2) == {"UNAUTHENTICATED": 2}

    assert keyed.redis_server is not None
    (ledger,) = keyed.others
    ledger.kill()  # no refill until the ledger is back: the router is on its own
    keyed.redis_server.kill()  # and it comes back from the old file, key and all
    shutil.copy(old_aof, keyed.redis_dir / "appendonly.aof")
    keyed.start_redis()
    assert keyed.redis_client().exists(mesh_state.api_key_key(key_hash(key)))
    time.sleep(0.3)  # past the router's cached verdict: it asks Redis again
    codes = keyed_calls(keyed, key, 50, concurrency=2)
    assert codes == {"UNAVAILABLE": 50}  # the old record is never trusted: retry later
    assert keyed_calls(keyed, kept, 5) == {"OK": 5}  # a key the router knows goes on
    ledger.start()
    wait_for(lambda: refilled(keyed), 10, "the ledger replaced the old state")
    records = keyed.redis_client().keys(mesh_state.api_key_key("*"))
    assert records == [mesh_state.api_key_key(key_hash(kept))]
    assert keyed_calls(keyed, key, 3) == {"UNAUTHENTICATED": 3}
    assert keyed_calls(keyed, kept, 3) == {"OK": 3}


def test_partial_state_is_made_whole(keyed: Mesh) -> None:
    admin = keyed.tenant_admin()
    admin.set_tenant("acme", TenantPolicy(models=("mlp",)))
    _, key = admin.create_key("acme")
    admin_redis = keyed.redis_client()
    (record,) = admin_redis.keys(mesh_state.api_key_key("*"))
    # tenants but not keys, and no version: refilled at the ledger's next pass
    admin_redis.delete(record, mesh_state.TENANTS_VERSION)
    wait_for(lambda: admin_redis.exists(record) == 1, 5, "the key record refilled")
    assert keyed_calls(keyed, key, 5) == {"OK": 5}
    # a key record lost while the version stayed: the periodic comparison (every 1 s here)
    admin_redis.delete(record)
    wait_for(lambda: admin_redis.exists(record) == 1, 5, "the key record restored")
    # a record Redis holds that the database never issued is removed
    forged = mesh_state.api_key_key("f" * 64)
    admin_redis.set(forged, '{"tenant": "acme", "key_id": "00000000", "created_ms": 1}')
    wait_for(lambda: admin_redis.exists(forged) == 0, 5, "the forged record removed")


def test_a_burst_answered_ok_before_kill_9_is_in_the_ledger(tmp_path: Path) -> None:
    """Redis kill -9'd right after a burst, with the router killed too (so nothing can send
    the batches again): the append-only file alone brings back every call answered OK."""
    mesh = Mesh(tmp_path / "logs")
    mesh.start_redis()
    try:
        mesh.add_worker(mlp_repository(tmp_path / "repo", mlp_config(max_batch=32)))
        mesh.wait_registered(1)
        # an OK is sent only once its record is in Redis (else: UNAVAILABLE, not billed)
        mesh.start_router("--no-auth", "--accounting-when-slow", "unavailable")
        codes = asyncio.run(call_many(mesh.router_address, 600, 8, 30.0))
        assert mesh.router is not None and mesh.redis_server is not None
        mesh.router.kill()
        mesh.redis_server.kill()
        assert codes["OK"] > 0
        mesh.restart_redis(0.5, keep_data=True)
        mesh.start_ledger("", "--interval-seconds", "0.2")
        wait_for(lambda: ledger_successes(mesh) >= codes["OK"], 20, "the ledger counted them")
        assert ledger_successes(mesh) == codes["OK"]
    finally:
        mesh.stop(kill=True)


def test_the_refill_is_idempotent(ledger_store: Store, tmp_path: Path) -> None:
    """Twice on the same Redis (SQLite and PostgreSQL directories): the second writes nothing
    and Redis holds the same bytes."""
    from ledger.refill import Refiller

    mesh = Mesh(tmp_path / "logs")
    mesh.start_redis()
    try:
        client = mesh.redis_client()
        admin = TenantAdmin(client, TenantDirectory(ledger_store))
        for name in ("a", "b"):
            admin.set_tenant(name, TenantPolicy(models=("mlp",), tokens_per_minute=100))
            admin.create_key(name)
        revoked_id, _ = admin.create_key("a")
        admin.revoke("a", revoked_id)
        client.flushall()
        refiller = Refiller(client, TenantDirectory(ledger_store), ledger_store, 60)
        assert refiller.check()
        raw = redis_conn.connect(mesh.redis_url, decode=False)
        first = {k: raw.dump(k) for k in sorted(raw.keys("*"))}
        assert len(client.keys(mesh_state.api_key_key("*"))) == 2
        assert refiller._write(TenantDirectory(ledger_store).snapshot()) == 0
        assert refiller.refill()
        assert {k: raw.dump(k) for k in sorted(raw.keys("*"))} == first
        assert not refiller.check()  # the version matches: nothing to do
    finally:
        mesh.stop(kill=True)
