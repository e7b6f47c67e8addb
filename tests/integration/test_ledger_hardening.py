"""The ledger process against what it should not trust or cannot reach: malformed and
forged batches, odd registrations, a database that drops its connection. Real
redis-server, ledger process, SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from common import mesh_state
from devmesh.testing import Mesh
from ledger.store import Store

PRICE = 250


def batch(counts: list[int], key: str = "mlp|1") -> dict[str, str]:
    return {"usage": json.dumps({key: counts}), "at_ms": "1000"}


def good(n: int) -> dict[str, str]:
    return batch([n, n, 0, n * PRICE, 0])


def registration(worker_id: str, **extra: object) -> str:
    return json.dumps(
        {
            "id": worker_id,
            "address": "127.0.0.1:1",
            "models": {"mlp": {"versions": ["1"], "max_queue": 8, "price_micro_usd": PRICE}},
            "provider": "CPUExecutionProvider",
            "started_ms": 1,
            **extra,
        }
    )


def success(store: Store) -> int:
    return store.usage().get(("mlp", "1"), {"success": 0})["success"]


def wait_for(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_bad_entries_are_quarantined_and_the_ledger_goes_on(mesh: Mesh, tmp_path: Path) -> None:
    r = mesh.redis_client()
    # Registrations: one from a newer worker (a field this ledger does not know), one junk.
    r.set(mesh_state.worker_key("w1"), registration("w1", zone="eu-1"))
    r.set(mesh_state.worker_key("junk"), "{not json")
    r.zadd(mesh_state.WORKERS, {"w1": mesh_state.now_ms(), "junk": mesh_state.now_ms()})
    stream = mesh_state.calls_stream("r1")
    r.sadd(mesh_state.ROUTERS, "r1")
    entries = [
        good(2),
        {"usage": "{not json", "at_ms": "1000"},
        batch([5, 5, 0, 5 * PRICE, 0], key="mlp|1|success"),  # not model|version
        batch([7, 7, 0, 1750, 0], key="ghost|1"),  # a model nobody serves
        batch([3, 9, 0, 9 * PRICE, 0]),  # successes beyond the calls
        batch([1, 1, 0, -PRICE, 0]),  # negative revenue for a success
        batch([1, 1, 0, PRICE]),  # a count missing
        {**good(1), "extra": "x"},  # a field the router never writes
        good(3),
    ]
    for seq, fields in enumerate(entries, start=1):
        r.xadd(stream, fields, id=f"1700000000000-{seq}")
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger = mesh.start_ledger(store.url, "--interval-seconds", "0.1")
    assert wait_for(lambda: success(store) == 5), store.usage()
    time.sleep(0.5)
    assert ledger.alive
    assert success(store) == 5 and set(store.usage()) == {("mlp", "1")}
    reasons = {entry_id: reason for _, entry_id, reason in store.quarantine()}
    assert sorted(reasons) == [f"1700000000000-{seq}" for seq in range(2, 9)], reasons
    assert "not one the mesh serves" in reasons["1700000000000-4"]
    assert store.gaps() == []
    assert r.get(mesh_state.ledger_ack_key("r1")) == "1700000000000-9"
    assert r.xlen(stream) == 0  # passed, not re-read forever
    # The ledger keeps going with what comes next.
    r.xadd(stream, good(4), id="1700000000000-10")
    assert wait_for(lambda: success(store) == 9)
    log = ledger.log.read_text()
    assert "ledger_registration_refused" in log and "Traceback" not in log
    assert log.count("ledger_registration_refused") == 1  # once, not every pass


def test_a_database_that_drops_the_connection_is_retried(mesh: Mesh, tmp_path: Path) -> None:
    import uuid

    psycopg = pytest.importorskip("psycopg")
    from tests.conftest import PG_URL

    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        pytest.skip(f"no PostgreSQL at {PG_URL}: {e}")
    schema = f"ledger_test_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE SCHEMA {schema}")
    url = f"{PG_URL}?options=-csearch_path%3D{schema}&application_name={schema}"
    try:
        store = Store(url)
        store.record_model("mlp", PRICE, 0)
        r = mesh.redis_client()
        r.sadd(mesh_state.ROUTERS, "r1")
        r.xadd(mesh_state.calls_stream("r1"), good(2), id="1700000000000-1")
        ledger = mesh.start_ledger(url, "--interval-seconds", "0.1")
        assert wait_for(lambda: success(store) == 2)
        for _ in range(3):  # the database kills the ledger's connection, three times
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                (schema,),
            )
            time.sleep(0.3)
        store = Store(url)  # ours was terminated too
        r.xadd(mesh_state.calls_stream("r1"), good(3), id="1700000000000-2")
        assert wait_for(lambda: success(store) == 5, timeout=20)
        assert ledger.alive
        assert "ledger_db_error_retrying" in ledger.log.read_text()
        ledger.stop()
        store.close()
    finally:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.close()
