"""What trust costs: the router with API keys + per-tenant rate limiting + TLS (and mutual TLS
to the worker, Redis ACL users) against the router with all of it off, same tiny MLP.

    python -m benchmarks.tenants [--seconds 5] [--rounds 4]

Four meshes, each started afresh per round, the order rotated from round to round:
"off" (`--no-auth`, plaintext, as `make run`); "auth" (API keys + rate limits + Redis ACL
users, plaintext); "tls" (TLS to the router, mutual TLS to the worker, no auth); "on" (all of
it). With auth, every call carries an API key (cached after its first look-up) and takes
one rate-limit decision from the router's lease (router/limits.py: a requests-per-second
bucket high enough never to refuse, plus a monthly spend cap, so each call's price is charged
in the background too). Closed loop at 1 caller (p50) and 32 callers (throughput), medians
over rounds. Target (issue 13): "on" against "off", >= 0.9x throughput and <= 0.2 ms added
p50. "auth" and "tls" say which part costs what; so do the auth path's parts timed in-process
(`components`) and the Redis scripts run per call (`scripts_per_call`: leases, charges and
the accounting appends, from Redis's INFO commandstats). Writes benchmarks/results/tenants.json.
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
from common import mesh_state
from common.tenancy import TenantPolicy, key_hash
from deploy import toy_models
from deploy.certs import make_certs
from deploy.processes import LocalMesh
from deploy.redis_acl import make_users, user_url
from loadtest import runner as loadtest_runner
from loadtest.runner import Load, measured
from router import limits
from router.auth import Auth
from router.keys import TenantAdmin
from router.limits import Limiter

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
CONFIG = "max_batch_size: 64\ndynamic_batching { default_queue_policy { max_queue_size: 2000 } }\n"
THROUGHPUT_TARGET = 0.9
P50_TARGET_MS = 0.2
CONFIGS = {"off": (False, False), "auth": (True, False), "tls": (False, True), "on": (True, True)}
POLICY = TenantPolicy(requests_per_second=1e6, burst=1_000_000, monthly_spend_cap_micro_usd=2**60)


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
    """The auth path's parts in this process, against the mesh's Redis as the router user;
    medians in microseconds over `n` sequential calls: a cached key (what a call pays), a key
    looked up in Redis (what the first call of a key pays, once per cache period), one
    rate-limit decision from the lease (what a call pays), one lease renewal (the LEASE
    script: what the background pays per renewal, and a call that finds its lease empty),
    and a bare Redis round trip (PING)."""
    assert mesh.users is not None
    redis = aioredis.from_url(
        user_url(mesh.redis_url, "router"),
        password=mesh.users.password("router"),
        decode_responses=True,
    )
    limiter = Limiter(redis)
    auth = Auth(redis, limiter, cache_s=3600)
    tenant = await auth.authenticate(metadata)
    key = metadata[0][1].split(" ", 1)[1]
    lease = redis.register_script(limits.LEASE)
    lease_keys = [
        mesh_state.limit_key("bench", "rps"),
        mesh_state.limit_key("bench", "tpm"),
        mesh_state.spend_key("bench", limits.month()),
    ]
    # give one token back, take one: the bucket is left as it was
    lease_args = [repr(POLICY.requests_per_second), POLICY.bucket_size, 0, 2**60, 1, 1]

    async def median_us(step: Callable[[], Awaitable[object]]) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await step()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1e6, 1)

    out = {
        "authenticate_cached_us": await median_us(lambda: auth.authenticate(metadata)),
        "key_lookup_redis_us": await median_us(lambda: auth._lookup(key, key_hash(key))),
        "admit_from_lease_us": await median_us(lambda: auth.admit(tenant, "mlp")),
        "lease_renewal_us": await median_us(lambda: lease(keys=lease_keys, args=lease_args)),
        "redis_ping_us": await median_us(redis.ping),
    }
    await limiter.close()
    await redis.aclose()
    return out


def scripts_run(mesh: LocalMesh) -> int:
    """Lua scripts Redis has run so far (EVALSHA and EVAL, every user)."""
    stats: dict = mesh.redis_client("admin").info("commandstats")  # type: ignore[assignment]
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def one_mesh(tmp: Path, label: str, seconds: float) -> dict:
    auth, secure = CONFIGS[label]
    mesh = LocalMesh(tmp / f"logs-{label}", worker_args=WORKER_ARGS)
    metadata: tuple[tuple[str, str], ...] = ()
    if secure:
        mesh.certs = make_certs(tmp / "certs")
    if auth:
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
        if auth:
            admin = TenantAdmin(mesh.redis_client("admin"))
            admin.set_tenant("bench", POLICY)
            metadata = (("authorization", f"Bearer {admin.create_key('bench')[1]}"),)
        x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
        body = infer_request("mlp", "INPUT0", x, "FP32").SerializeToString()
        credentials = mesh.client_credentials()
        out: dict = {"c1": asyncio.run(closed(router, body, 1, seconds, credentials, metadata))}
        before, t0 = scripts_run(mesh), time.monotonic()
        out["c32"] = asyncio.run(closed(router, body, 32, seconds, credentials, metadata))
        # scripts per second (warm-up included, at the same rate) over calls per second
        per_s = (scripts_run(mesh) - before) / (time.monotonic() - t0)
        out["c32"]["scripts_per_call"] = round(per_s / max(out["c32"]["throughput_rps"], 1), 4)
        if auth:
            out["components"] = asyncio.run(components(mesh, metadata, 2000))
        return out
    finally:
        mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    labels = list(CONFIGS)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label in labels[i % 4 :] + labels[: i % 4]:  # each config in each place once
                runs[label].append(one_mesh(Path(tmp), label, args.seconds))
                print(label, runs[label][-1], flush=True)
    load_after = os.getloadavg()

    def median(label: str, point: str, key: str) -> float:
        return statistics.median(r[point][key] for r in runs[label])

    p50 = {label: median(label, "c1", "p50_ms") for label in labels}
    rps = {label: median(label, "c32", "throughput_rps") for label in labels}
    ratio = {label: round(rps[label] / rps["off"], 3) for label in labels}
    added = {label: round(p50[label] - p50["off"], 3) for label in labels}
    errors = {label: [r[p]["errors"] for r in runs[label] for p in ("c1", "c32")] for label in runs}
    scripts = {
        label: statistics.median(r["c32"].get("scripts_per_call", 0.0) for r in runs[label])
        for label in labels
    }
    parts = {
        k: statistics.median(r["components"][k] for r in runs["on"])
        for k in runs["on"][0]["components"]
    }
    met_rps = ratio["on"] >= THROUGHPUT_TARGET
    met_p50 = added["on"] <= P50_TARGET_MS
    reading = [
        f"throughput at 32 callers: {rps['on']:.0f} req/s with auth + limits + TLS, "
        f"{rps['off']:.0f} without: {ratio['on']:.2f}x "
        f"({'meets' if met_rps else 'misses'} the >= {THROUGHPUT_TARGET}x target); "
        f"auth + limits alone {ratio['auth']:.2f}x, TLS alone {ratio['tls']:.2f}x",
        f"p50 at 1 caller: {p50['on']:.3f} ms against {p50['off']:.3f} ms: {added['on']:+.3f} ms "
        f"({'meets' if met_p50 else 'misses'} the <= {P50_TARGET_MS} ms target); "
        f"auth + limits alone {added['auth']:+.3f} ms, TLS alone {added['tls']:+.3f} ms",
        f"the auth path's parts in-process: a cached key {parts['authenticate_cached_us']:.0f} us "
        f"(a key looked up in Redis: {parts['key_lookup_redis_us']:.0f} us, once per key per "
        f"cache period), a rate-limit decision from the lease "
        f"{parts['admit_from_lease_us']:.0f} us (a lease renewal in the background: "
        f"{parts['lease_renewal_us']:.0f} us; a bare Redis round trip: "
        f"{parts['redis_ping_us']:.0f} us); Redis scripts per call at 32 callers: "
        f"{scripts['on']:.3f} on, {scripts['off']:.3f} off (accounting appends)",
        f"1-minute load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, on "
        f"{os.cpu_count()} cores"
        + (
            ": other work held the cores, so these latencies include waiting for a core"
            if max(load_before[0], load_after[0]) > (os.cpu_count() or 1)
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
        "throughput_ratio": ratio,
        "added_p50_ms": added,
        "scripts_per_call_c32": scripts,
        "components_us": parts,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "errors": errors,
        "reading": reading,
    }
    path = write_result("tenants", payload)
    print("\n".join(reading))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
