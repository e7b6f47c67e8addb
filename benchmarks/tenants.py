"""What trust costs: the router with API keys + per-tenant rate limiting + TLS (and mutual TLS
to the worker, Redis ACL users) against the router with all of it off, same tiny MLP.

    python -m benchmarks.tenants [--calls 2500] [--slices 8] [--seconds 1.5] [--quick]

Four meshes run side by side, so that whatever else the machine does falls on all of them
alike: "off" (`--no-auth`, plaintext, as `make run`); "auth" (API keys + rate limits + Redis
ACL users, plaintext); "tls" (TLS to the router, mutual TLS to the worker, no auth); "on"
(all of it). With auth, every call carries an API key (cached after its first look-up) and
takes one rate-limit decision from the router's lease (router/tenancy/limits.py: a
requests-per-second bucket high enough never to refuse, plus a monthly spend cap, so each
call's price is charged in the background too).

- p50, 1 caller: `--calls` rounds of one call to each mesh, the order rotated each round;
  the p50 of each, and the added p50 in each fifth of the rounds (its spread: the noise);
- throughput, 32 callers (closed loop): `--slices` slices of `--seconds` on each mesh in
  turn, the order rotated; the median over slices, and the median of the per-slice ratios.

Target (issue 13): "on" against "off", >= 0.9x throughput and <= 0.2 ms added p50. "auth"
and "tls" say which part costs what; so do the auth path's parts timed in-process
(`components`) and the Redis scripts run per call (`scripts_per_call`: leases, charges and
the accounting appends, from Redis's INFO commandstats), and the CPU each process spends per
call at 32 callers (from /proc: what a call costs the cores, whatever else runs on them).
Writes benchmarks/results/tenants.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from benchmarks.auth_path import components
from benchmarks.common import check, figure, infer_request, machine, parse, write_result
from benchmarks.mesh_cost import cpu_seconds, scripts_run
from common import tls
from common.rpc import message_options
from common.tenancy import TenantPolicy
from devmesh import toy_models
from devmesh.certs import make_certs
from devmesh.processes import LocalMesh
from devmesh.redis_acl import make_users
from loadtest import runner as loadtest_runner
from loadtest.runner import METHOD, Load, measured

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
CONFIG = "max_batch_size: 64\ndynamic_batching { default_queue_policy { max_queue_size: 2000 } }\n"
THROUGHPUT_TARGET = 0.9
P50_TARGET_MS = 0.2
CONFIGS = {"off": (False, False), "auth": (True, False), "tls": (False, True), "on": (True, True)}
POLICY = TenantPolicy(requests_per_second=1e6, burst=1_000_000, monthly_spend_cap_micro_usd=2**60)
BLOCKS = 5  # the p50 rounds are cut in this many blocks to show the noise


@dataclass
class Target:
    label: str
    mesh: LocalMesh
    address: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]


def start(tmp: Path, label: str) -> Target:
    auth, secure = CONFIGS[label]
    mesh = LocalMesh(tmp / f"logs-{label}", worker_args=WORKER_ARGS)
    metadata: tuple[tuple[str, str], ...] = ()
    if secure:
        mesh.certs = make_certs(tmp / f"certs-{label}")
    if auth:
        mesh.users = make_users(tmp / f"secrets-{label}")
        mesh.auth = True
    mesh.start_redis()
    repo = tmp / "repo"
    if not (repo / "mlp").exists():
        toy_models.write(repo / "mlp", toy_models.mlp(), CONFIG)
    mesh.add_worker(repo)
    mesh.wait_registered(1)
    address = mesh.start_router()
    if auth:
        admin = mesh.tenant_admin()
        admin.set_tenant("bench", POLICY)
        metadata = (("authorization", f"Bearer {admin.create_key('bench')[1]}"),)
    return Target(label, mesh, address, mesh.client_credentials(), metadata)


def rotated(labels: list[str], i: int) -> list[str]:
    return labels[i % len(labels) :] + labels[: i % len(labels)]


async def paired_latency(targets: dict[str, Target], body: bytes, calls: int) -> dict:
    """Milliseconds of each call, one call to each mesh per round (1 caller)."""
    channels = {
        label: tls.aio_channel(t.address, t.credentials, message_options())
        for label, t in targets.items()
    }
    stubs = {label: channel.unary_unary(METHOD) for label, channel in channels.items()}
    labels = list(targets)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for i in range(-200, calls):  # 200 warm-up rounds
        for label in rotated(labels, i):
            t0 = time.perf_counter()
            await stubs[label](body, timeout=10, metadata=targets[label].metadata)
            if i >= 0:
                times[label].append((time.perf_counter() - t0) * 1e3)
    for channel in channels.values():
        await channel.close()
    return times


async def closed(target: Target, body: bytes, seconds: float) -> dict:
    load = Load(
        target.address,
        [body],
        seconds,
        0.3,
        30.0,
        credentials=target.credentials,
        metadata=target.metadata,
    )
    return measured(await loadtest_runner.closed_loop(load, 32))


def throughput_slices(targets: dict[str, Target], body: bytes, slices: int, seconds: float) -> dict:
    """Per slice: the closed loop's result, Redis scripts per call, and CPU milliseconds per
    call of each process (warm-up included, at the same rate: per second over calls per
    second). CPU per call is what the 2 cores pay for a call, and far less noisy than the
    rate on a shared machine (time spent waiting for a core is not in it)."""
    out: dict[str, list[dict]] = {label: [] for label in targets}
    for i in range(slices):
        for label in rotated(list(targets), i):
            mesh = targets[label].mesh
            scripts, cpu, t0 = scripts_run(mesh), cpu_seconds(mesh), time.monotonic()
            result = asyncio.run(closed(targets[label], body, seconds))
            elapsed = time.monotonic() - t0
            calls_per_s = max(result["throughput_rps"], 1)
            per_s = (scripts_run(mesh) - scripts) / elapsed
            result["scripts_per_call"] = round(per_s / calls_per_s, 4)
            used = cpu_seconds(mesh)
            result["cpu_ms_per_call"] = {
                role: round((used[role] - cpu[role]) / elapsed / calls_per_s * 1e3, 4)
                for role in used
            }
            out[label].append(result)
    return out


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    args = _parse_args()
    labels = list(CONFIGS)
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    body = infer_request("mlp", "INPUT0", x, "FP32").SerializeToString()
    load_before = os.getloadavg()
    latency, slices, parts = _measure(labels, body, args)
    load_after = os.getloadavg()
    f = _figures(labels, latency, slices, args.calls)
    payload = {
        "machine": machine(),
        "note": "2-core AMD EPYC, no GPU, shared with other work: the client, 4 routers, "
        "4 workers and 4 Redis on the same 2 cores",
        "calls": args.calls,
        "slices_per_mesh": args.slices,
        "seconds_per_slice": args.seconds,
        "p50_ms_c1": f.p50s,
        "p99_ms_c1": {
            label: round(float(np.percentile(latency[label], 99)), 3) for label in labels
        },
        "added_p50_ms": f.added,
        "added_p50_ms_per_block": f.blocks,
        "throughput_rps_c32": f.rps,
        "throughput_ratio": f.ratio,
        "throughput_ratio_per_slice": f.ratios,
        "scripts_per_call_c32": f.scripts,
        "cpu_ms_per_call_c32": f.cpu,
        "cpu_ms_per_call_c32_total": f.cpu_total,
        "slices": slices,
        "components_us": parts,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "errors": f.errors,
    }
    path = write_result("tenants", payload, TITLE, rows(payload), args.quick)
    for row in rows(payload):
        print(*row)
    print(f"wrote {path}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2500, help="p50 rounds")
    parser.add_argument("--slices", type=int, default=8, help="throughput slices per mesh")
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per slice")
    return parse(parser, calls=500, slices=2, seconds=1.0)


def _measure(labels: list[str], body: bytes, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """The four meshes side by side: the paired latencies, the throughput slices and the auth
    path's parts (on the "on" mesh)."""
    targets: dict[str, Target] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for label in labels:
                targets[label] = start(Path(tmp), label)
            latency = asyncio.run(paired_latency(targets, body, args.calls))
            slices = throughput_slices(targets, body, args.slices, args.seconds)
            on = targets["on"]
            parts = asyncio.run(components(on.mesh, on.metadata, "bench", POLICY, 2000))
        finally:
            for target in targets.values():
                target.mesh.stop()
    return latency, slices, parts


@dataclass(frozen=True)
class _Figures:
    """Per mesh label: the figures the payload quotes."""

    p50s: dict[str, float]  # ms at 1 caller
    added: dict[str, float]  # p50 over "off"'s, ms
    blocks: dict[str, list[float]]  # added p50 in each of BLOCKS blocks of rounds
    rps: dict[str, float]  # median over slices at 32 callers
    ratios: dict[str, list[float]]  # per slice, to "off"'s
    ratio: dict[str, float]  # their median
    scripts: dict[str, float]  # Redis scripts per call
    errors: dict[str, list]
    cpu: dict[str, dict[str, float]]  # CPU ms per call by process role
    cpu_total: dict[str, float]


def _figures(labels: list[str], latency: dict, slices: dict, calls: int) -> _Figures:
    p50s = {label: p50(latency[label]) for label in labels}
    step = calls // BLOCKS
    blocks = {
        label: [
            round(
                p50(latency[label][b * step : (b + 1) * step])
                - p50(latency["off"][b * step : (b + 1) * step]),
                3,
            )
            for b in range(BLOCKS)
        ]
        for label in labels
    }
    ratios = {
        label: [
            round(a["throughput_rps"] / max(b["throughput_rps"], 1), 3)
            for a, b in zip(slices[label], slices["off"], strict=True)
        ]
        for label in labels
    }
    cpu = {
        label: {
            role: round(statistics.median(r["cpu_ms_per_call"][role] for r in slices[label]), 4)
            for role in slices[label][0]["cpu_ms_per_call"]
        }
        for label in labels
    }
    return _Figures(
        p50s=p50s,
        added={label: round(p50s[label] - p50s["off"], 3) for label in labels},
        blocks=blocks,
        rps={
            label: statistics.median(r["throughput_rps"] for r in slices[label]) for label in labels
        },
        ratios=ratios,
        ratio={label: round(statistics.median(ratios[label]), 3) for label in labels},
        scripts={
            label: statistics.median(r["scripts_per_call"] for r in slices[label])
            for label in labels
        },
        errors={label: [r["errors"] for r in slices[label] if r["errors"]] for label in labels},
        cpu=cpu,
        cpu_total={label: round(sum(cpu[label].values()), 4) for label in labels},
    )


TITLE = "Tenants, keys and TLS: what trust costs"


def rows(r: dict) -> list[list]:
    """Headline rows: everything on against everything off (the targets), and each part."""
    ratio, added, cpu = r["throughput_ratio"], r["added_p50_ms"], r["cpu_ms_per_call_c32_total"]
    parts = r["components_us"]
    return [
        check("all on / off: req/s at 32 callers", ratio["on"], THROUGHPUT_TARGET, False, "x"),
        check("all on: added p50 at 1 caller", added["on"], P50_TARGET_MS, True, " ms"),
        figure(
            "auth + limits alone / TLS alone: req/s ratio", f"{ratio['auth']}x / {ratio['tls']}x"
        ),
        figure(
            "auth + limits alone / TLS alone: added p50", f"{added['auth']} / {added['tls']} ms"
        ),
        figure("CPU ms per call at 32 callers, off / on", f"{cpu['off']} / {cpu['on']}"),
        figure(
            "in-process: a cached key / a lease's admit / a Redis round trip",
            f"{parts['authenticate_cached_us']:.0f} / {parts['admit_from_lease_us']:.0f} / "
            f"{parts['redis_ping_us']:.0f} us",
        ),
    ]


if __name__ == "__main__":
    main()
