"""What trust costs: the router with API keys + per-tenant rate limiting + TLS (and mutual TLS
to the worker, Redis ACL users) against the router with all of it off, same tiny MLP.

    python -m benchmarks.tenants [--seconds 5] [--rounds 2]

"On": every call carries an API key (cached after its first look-up), runs one rate-limit
decision (a Lua script in Redis: a requests-per-second bucket high enough never to refuse,
plus a monthly spend cap, so each call's price is charged in the background too), and
travels over TLS to the router and mutual TLS to the worker. "Off": `--no-auth`, plaintext,
as `make run`. Closed loop at 1 caller (p50) and 32 callers (throughput), rounds alternated
off/on, medians over rounds. Target (issue 13): >= 0.9x throughput and <= 0.2 ms added p50.
Writes benchmarks/results/tenants.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import redis.asyncio as aioredis

from benchmarks.common import infer_request, machine, write_result
from common.tenancy import TenantPolicy
from deploy import toy_models
from deploy.certs import make_certs
from deploy.processes import LocalMesh
from deploy.redis_acl import make_users, user_url
from loadtest import runner as loadtest_runner
from loadtest.runner import Load, measured
from router.auth import Auth
from router.keys import TenantAdmin
from router.limits import Limiter

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
CONFIG = "max_batch_size: 64\ndynamic_batching { default_queue_policy { max_queue_size: 2000 } }\n"
THROUGHPUT_TARGET = 0.9
P50_TARGET_MS = 0.2


async def closed(
    address: str,
    body: bytes,
    concurrency: int,
    seconds: float,
    credentials: grpc.ChannelCredentials | None,
    metadata: tuple[tuple[str, str], ...],
) -> dict:
    load = Load(address, [body], seconds, 1.0, 30.0, credentials=credentials, metadata=metadata)
    return measured(await loadtest_runner.closed_loop(load, concurrency))


async def components(mesh: LocalMesh, metadata: tuple[tuple[str, str], ...], n: int) -> dict:
    """The auth path's parts in this process, against the mesh's Redis as the router user:
    a cached key look-up, one rate-limit decision (the Lua script), and a bare Redis PING
    for the round trip it contains; medians in microseconds over `n` sequential calls."""
    assert mesh.users is not None
    redis = aioredis.from_url(
        user_url(mesh.redis_url, "router"),
        password=mesh.users.password("router"),
        decode_responses=True,
    )
    auth = Auth(redis, Limiter(redis), cache_s=3600)
    tenant = await auth.authenticate(metadata)

    async def median_us(step: Callable[[], Awaitable[object]]) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await step()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e6, 1)

    out = {
        "authenticate_cached_us": await median_us(lambda: auth.authenticate(metadata)),
        "admit_lua_us": await median_us(lambda: auth.admit(tenant, "mlp")),
        "redis_ping_us": await median_us(redis.ping),
    }
    await redis.aclose()
    return out


def one_mesh(tmp: Path, secure: bool, seconds: float) -> dict:
    mesh = LocalMesh(tmp / f"logs-{'on' if secure else 'off'}", worker_args=WORKER_ARGS)
    metadata: tuple[tuple[str, str], ...] = ()
    if secure:
        mesh.certs = make_certs(tmp / "certs")
        mesh.users = make_users(tmp / "secrets")
        mesh.auth = True
    mesh.start_redis()
    try:
        repo = tmp / "repo"
        if not (repo / "mlp").exists():
            toy_models.write(repo / "mlp", toy_models.mlp(), CONFIG)
        mesh.add_worker(repo)
        mesh.wait_registered(1)
        router = mesh.start_router()
        if secure:
            admin = TenantAdmin(mesh.redis_client("admin"))
            admin.set_tenant(
                "bench",
                TenantPolicy(
                    requests_per_second=1e6, burst=1_000_000, monthly_spend_cap_micro_usd=2**60
                ),
            )
            metadata = (("authorization", f"Bearer {admin.create_key('bench')[1]}"),)
        x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
        body = infer_request("mlp", "INPUT0", x, "FP32").SerializeToString()
        credentials = mesh.client_credentials()
        out = {
            f"c{c}": asyncio.run(closed(router, body, c, seconds, credentials, metadata))
            for c in (1, 32)
        }
        if secure:
            out["components"] = asyncio.run(components(mesh, metadata, 2000))
        return out
    finally:
        mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label in ("off", "on") if i % 2 == 0 else ("on", "off"):
                runs[label].append(one_mesh(Path(tmp), label == "on", args.seconds))
                print(label, runs[label][-1], flush=True)

    def median(label: str, point: str, key: str) -> float:
        return statistics.median(r[point][key] for r in runs[label])

    load = round(max(load_before, os.getloadavg()[0]), 1)
    p50 = {label: median(label, "c1", "p50_ms") for label in runs}
    rps = {label: median(label, "c32", "throughput_rps") for label in runs}
    ratio = rps["on"] / rps["off"]
    added = p50["on"] - p50["off"]
    errors = {label: [r[p]["errors"] for r in runs[label] for p in ("c1", "c32")] for label in runs}
    parts = {
        k: statistics.median(r["components"][k] for r in runs["on"])
        for k in runs["on"][0]["components"]
    }
    reading = [
        f"throughput at 32 callers: {rps['on']:.0f} req/s with auth + limits + TLS, "
        f"{rps['off']:.0f} without: {ratio:.2f}x "
        f"({'meets' if ratio >= THROUGHPUT_TARGET else 'misses'} the >= {THROUGHPUT_TARGET}x "
        "target)",
        f"p50 at 1 caller: {p50['on']:.3f} ms against {p50['off']:.3f} ms: {added:+.3f} ms "
        f"({'meets' if added <= P50_TARGET_MS else 'misses'} the <= {P50_TARGET_MS} ms target)",
        f"the auth path's parts in-process: a cached key look-up "
        f"{parts['authenticate_cached_us']:.0f} us, a rate-limit decision "
        f"{parts['admit_lua_us']:.0f} us, of which a bare Redis round trip (PING) is "
        f"{parts['redis_ping_us']:.0f} us",
        f"1-minute load average around the run: {load} on {os.cpu_count()} cores"
        + (
            ": other work held the cores, so these latencies are mostly waiting for a core"
            if load > (os.cpu_count() or 1)
            else ""
        ),
    ]
    payload = {
        "machine": machine(),
        "note": "2-core AMD EPYC, no GPU, shared with other work: client, router, Redis and "
        "worker on the same 2 cores",
        "seconds": args.seconds,
        "rounds": args.rounds,
        "runs": runs,
        "p50_ms_c1": p50,
        "throughput_rps_c32": rps,
        "throughput_ratio": round(ratio, 3),
        "added_p50_ms": round(added, 3),
        "components_us": parts,
        "load_average": load,
        "errors": errors,
        "reading": reading,
    }
    path = write_result("tenants", payload)
    print("\n".join(reading))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
