"""The router's accounting against a real redis-server: the append script never reports a
batch as written when it was not."""

from __future__ import annotations

import asyncio

from common import mesh_state
from devmesh.testing import Mesh
from router.money.accounting import Accounting


def test_an_id_below_the_stream_is_refused_not_swallowed(mesh: Mesh) -> None:
    r = mesh.redis_client()
    stream = mesh_state.calls_stream("r1")
    # Another process under the same router id already wrote far above this one's epoch.
    r.xadd(stream, {"usage": "{}", "at_ms": "0"}, id="9999999999999-1")

    async def run() -> tuple[bool, int, bool, int]:
        accounting = Accounting(mesh.redis_url, "r1")
        accounting._epoch_checked = True  # as if the other process wrote after our check
        accounting.record("mlp", "1", True, 250)
        refused = await accounting.flush()
        unsent = len(accounting._unsent)
        # A resend of a batch Redis already holds (its reply was lost) is not an error.
        accounting2 = Accounting(mesh.redis_url, "r2")
        accounting2.record("mlp", "1", True, 250)
        assert await accounting2.flush()
        again = await accounting2._send(accounting2._retained)
        await accounting.redis.aclose()
        await accounting2.redis.aclose()
        return refused, unsent, again == 1, r.xlen(mesh_state.calls_stream("r2"))

    refused, unsent, resent, length = asyncio.run(run())
    assert refused is False and unsent == 1  # kept in memory, not reported as written
    assert r.xlen(stream) == 1  # and nothing slipped in
    assert resent and length == 1


def test_a_restarted_router_starts_above_what_redis_holds(mesh: Mesh) -> None:
    r = mesh.redis_client()
    future = mesh_state.now_ms() + 3_600_000  # a previous process whose clock ran ahead
    r.xadd(mesh_state.calls_stream("r1"), {"usage": "{}", "at_ms": "0"}, id=f"{future}-7")

    async def run() -> bool:
        accounting = Accounting(mesh.redis_url, "r1")
        accounting.record("mlp", "1", True, 250)
        ok = await accounting.flush()
        await accounting.redis.aclose()
        return ok

    assert asyncio.run(run())
    ((last_id, _),) = r.xrevrange(mesh_state.calls_stream("r1"), count=1)
    assert last_id == f"{future + 1}-1"


def test_batches_a_lagging_replica_lost_are_sent_again(mesh: Mesh) -> None:
    """Redis took over from a primary without the router's last batches (the stream is
    there, only shorter): the router appends them again before the new one."""
    r = mesh.redis_client()
    stream = mesh_state.calls_stream("r1")

    async def run() -> list[str]:
        accounting = Accounting(mesh.redis_url, "r1")
        for _ in range(3):
            accounting.record("mlp", "1", True, 250)
            assert await accounting.flush()
        (first_id, first), *rest = r.xrange(stream)
        lost = [entry_id for entry_id, _ in rest]
        r.delete(stream)  # the replica had only the first batch when it took over
        r.xadd(stream, first, id=first_id)
        accounting.record("mlp", "1", True, 250)
        assert await accounting.flush()
        await accounting.redis.aclose()
        return lost

    lost = asyncio.run(run())
    ids = [entry_id for entry_id, _ in r.xrange(stream)]
    assert len(ids) == 4 and ids[1:3] == lost  # every batch once, in order


def test_a_batch_names_its_router_for_the_ledger_as_it_is_appended(mesh: Mesh) -> None:
    """The ledger drains the routers in meshserve:routers. A router killed after its first
    append, before its live totals were ever written, must be in that set already, or the
    billed pieces its client received would never reach the ledger."""
    r = mesh.redis_client()

    async def run() -> None:
        accounting = Accounting(mesh.redis_url, "r1")  # never started: no totals loop
        accounting.record("mlp", "1", True, 250)
        assert await accounting.flush()
        await accounting.redis.aclose()

    asyncio.run(run())
    assert r.xlen(mesh_state.calls_stream("r1")) == 1
    assert r.smembers(mesh_state.ROUTERS) == {"r1"}
    assert not r.exists(mesh_state.usage_key("r1"))  # the live view was not what put it there
