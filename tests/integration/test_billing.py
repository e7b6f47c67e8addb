"""Billing under calls the clients give up on: real redis-server, workers, router, ledger.

The durable ledger must count as successes (and bill) exactly the calls whose client got an
OK reply: not a call whose deadline passed, not one the client cancelled, not one the
router answered too late, and not one lost with a router restarted under the same id.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import grpc

from devmesh import toy_models
from devmesh.testing import Mesh, call_many, mlp_config, mlp_repository, mlp_request, settle
from ledger.store import Store
from protos import grpc_service_pb2_grpc as pb_grpc

PRICE = 250  # micro-USD, from mlp_config


def start(mesh: Mesh, tmp_path: Path, *router_args: str) -> tuple[str, Store]:
    """Two workers serving `mlp` (1 ms a call) and `mlp_slow` (150 ms), a router, a ledger."""
    repo = mlp_repository(tmp_path / "repo", mlp_config(simulated_us=1000, queue=1024))
    toy_models.write(
        repo / "mlp_slow", toy_models.mlp(), mlp_config(simulated_us=150_000, queue=1024)
    )
    mesh.add_worker(repo)
    mesh.add_worker(repo)
    mesh.wait_registered(2)
    router = mesh.start_router(*router_args)
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    mesh.start_ledger(store.url, "--interval-seconds", "0.1")
    return router, store


def billed(store: Store) -> tuple[int, int]:
    u = store.usage()
    return sum(v["success"] for v in u.values()), sum(v["revenue_micro_usd"] for v in u.values())


async def impatient_clients(
    address: str, calls: int, seed: int, max_seconds: float = 40.0
) -> dict[str, Counter[str]]:
    """`calls` ModelInfer calls, 8 at a time: half to `mlp` with deadlines of 1-120 ms, half
    to `mlp_slow`, each cancelled by its client after 1-20 ms. Returns what the clients saw:
    model -> status name -> count. (Deadlines reach 120 ms so that some calls succeed on a
    slow or busy machine too, past the test's 50 ms answer margin: at 1-20 ms an AVX2-only
    2-core box saw 1-6 of 250 succeed.)"""
    rng = random.Random(seed)
    seen: dict[str, Counter[str]] = {"mlp": Counter(), "mlp_slow": Counter()}
    next_i = 0
    stop_at = time.monotonic() + max_seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def with_deadline(i: int, wait_s: float) -> str:
            try:
                await stub.ModelInfer(mlp_request(i), timeout=wait_s)
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        async def cancelled(i: int, wait_s: float) -> str:
            request = mlp_request(i)
            request.model_name = "mlp_slow"
            call = stub.ModelInfer(request, timeout=10)
            await asyncio.sleep(wait_s)
            call.cancel()
            try:
                await call
                return "OK"  # it had finished before the cancel: the client got it
            except asyncio.CancelledError:
                return "CANCELLED"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        async def caller() -> None:
            nonlocal next_i
            while next_i < calls and time.monotonic() < stop_at:
                i, next_i = next_i, next_i + 1
                if i % 2:
                    seen["mlp"][await with_deadline(i, rng.uniform(0.001, 0.120))] += 1
                else:
                    seen["mlp_slow"][await cancelled(i, rng.uniform(0.001, 0.020))] += 1

        await asyncio.gather(*(caller() for _ in range(8)))
    return seen


def billed_per_model(store: Store) -> dict[str, int]:
    return {m: u["success"] for (m, _), u in store.usage().items()}


def test_deadlines_and_cancels_bill_exactly_what_the_clients_got(
    mesh: Mesh, tmp_path: Path
) -> None:
    # The margin must cover a reply's trip back to the client, into its event loop: HTTP/2
    # has no ack, so a reply sent with less left may land after the client's deadline and be
    # billed though the client saw DEADLINE_EXCEEDED. On this 2-core machine, loaded, that
    # trip took over 5 ms (69 billed, 68 received), and over 20 ms with other test suites on
    # the same cores (145 billed, 144 received); the default, 2 ms, is for an idle client.
    router, store = start(mesh, tmp_path, "--answer-margin-ms", "50")
    seen = asyncio.run(impatient_clients(router, 1000, seed=8))
    fast, slow = seen["mlp"], seen["mlp_slow"]
    # The mix the test is about did happen: successes, expired deadlines and cancels.
    assert fast["OK"] >= 20 and fast["DEADLINE_EXCEEDED"] >= 20, seen
    assert slow["CANCELLED"] >= 100, seen
    assert set(fast) <= {"OK", "DEADLINE_EXCEEDED"} and set(slow) <= {"OK", "CANCELLED"}, seen
    ok = fast["OK"] + slow["OK"]
    got = settle(lambda: billed(store), (ok, ok * PRICE), timeout=15, quiet=1.5)
    assert billed_per_model(store).get("mlp", 0) == fast["OK"], seen
    assert billed_per_model(store).get("mlp_slow", 0) == slow["OK"], seen
    assert got == (ok, ok * PRICE), seen


def test_a_router_restarted_under_the_same_id_loses_no_count(mesh: Mesh, tmp_path: Path) -> None:
    router, store = start(mesh, tmp_path, "--router-id", "router-a")
    first = asyncio.run(call_many(router, 300, concurrency=4))
    assert first == {"OK": 300}
    assert settle(lambda: billed(store), (300, 300 * PRICE), timeout=15, quiet=1.5) == (
        300,
        300 * PRICE,
    )
    assert mesh.router is not None
    mesh.router.stop()  # as compose restarts PID 1: the same default id again
    router = mesh.start_router("--router-id", "router-a")
    second = asyncio.run(call_many(router, 200, concurrency=4))
    assert second == {"OK": 200}
    assert settle(lambda: billed(store), (500, 500 * PRICE), timeout=15, quiet=1.5) == (
        500,
        500 * PRICE,
    )
    assert store.gaps() == [] and store.quarantine() == []
