"""The router against nginx as a plain gRPC proxy, in one run, over the same 2 workers.

    python -m benchmarks.router_scale [--seconds 5]

Paths, each at concurrency 1, 8 and 32 (closed loop, the `mlp` toy model, batch 1):
- direct: the client balances over both workers itself (gRPC round_robin);
- nginx: nginx-light, `grpc_pass` to both workers (round robin, keepalive upstream
  connections), 2 worker processes: the floor a proxy written in C sets;
- python-floor: benchmarks/bare_proxy.py, grpc.aio passing the bytes on with gRPC's round
  robin and nothing else (no policy, accounting, metrics, failover): what any Python gRPC
  proxy costs, so what the router's own work adds is told apart from what Python costs;
- router-1, router-2: `python -m router --processes 1|2`, with p2c and accounting on.

The client spreads its calls over up to 8 TCP connections, so that a server of several
processes (nginx's workers, the router's processes on one SO_REUSEPORT port) gets all of
them busy. Client, proxies, workers and Redis share this machine's cores; the CPU seconds
each part used per point are recorded. Writes benchmarks/results/router_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.common import (
    cpu_seconds,
    free_port,
    infer_request,
    machine,
    process_tree,
    spawn,
    wait_ready,
    write_result,
)
from benchmarks.readings import table
from devmesh import toy_models
from devmesh.processes import LocalMesh
from loadtest import runner
from loadtest.runner import Load, measured

CONCURRENCY = (1, 8, 32)
MAX_CONNECTIONS = 8
WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
NGINX_CONF = """\
worker_processes 2;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    upstream workers {{
        {servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} http2;
        location / {{ grpc_pass grpc://workers; }}
    }}
}}
"""


@contextlib.contextmanager
def nginx(tmp: Path, workers: list[str]) -> Iterator[tuple[str, int]]:
    """nginx as a gRPC proxy over `workers`: its address and master pid while the block runs."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        raise SystemExit("no nginx: apt-get install nginx-light (Debian), then run again")
    port = free_port()
    servers = "\n        ".join(f"server {w};" for w in workers)
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, servers=servers, port=port))
    log = (tmp / "nginx.out").open("w")
    process = subprocess.Popen(
        [binary, "-p", str(tmp), "-e", str(tmp / "nginx-error.log"), "-c", str(conf)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(f"127.0.0.1:{port}")
        yield f"127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(10)


def point(address: str, request: bytes, c: int, seconds: float, pids: dict[str, list[int]]) -> dict:
    """One closed-loop point, with the CPU seconds each part used during it."""
    options: tuple[tuple[str, str | int], ...] = ()
    if address.startswith("ipv4:"):
        options = (("grpc.lb_policy_name", "round_robin"),)
    load = Load(
        address,
        [request],
        seconds,
        warmup=1.0,
        connections=min(c, MAX_CONNECTIONS),
        channel_options=options,
    )
    before = {part: cpu_seconds(p) for part, p in pids.items()}
    result = measured(asyncio.run(runner.closed_loop(load, c)))
    wall = seconds + 1.0
    used = {part: cpu_seconds(p) - before[part] for part, p in pids.items()}
    result["cpu_cores"] = {part: round(s / wall, 2) for part, s in used.items()}
    # Warm-up included: its calls are assumed to come at the measured rate.
    calls = result["throughput_rps"] * wall
    result["proxy_cpu_us_per_call"] = round(used["proxy"] / calls * 1e6) if calls else None
    result.pop("cdf", None)
    return result


def run(tmp: Path, seconds: float) -> dict[str, list[dict]]:
    repo = tmp / "models"
    toy_models.write(repo / "mlp", toy_models.mlp(), toy_models.MLP_CONFIG)
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    request = infer_request("mlp", "INPUT0", x, "FP32").SerializeToString()
    mesh = LocalMesh(tmp / "logs", worker_args=WORKER_ARGS)
    mesh.start_redis()
    results: dict[str, list[dict]] = {}
    try:
        workers = [mesh.add_worker(repo) for _ in range(2)]
        mesh.wait_registered(2)
        worker_pids = [p.popen.pid for p in mesh.workers.values() if p.popen]
        assert mesh.redis_server is not None and mesh.redis_server.popen is not None
        base = {
            "client": [os.getpid()],
            "workers": worker_pids,
            "redis": [mesh.redis_server.popen.pid],
        }

        def measure(label: str, address: str, proxy_pids: list[int]) -> None:
            parts = {**base, "proxy": proxy_pids}
            results[label] = []
            for c in CONCURRENCY:
                row = {"concurrency": c, **point(address, request, c, seconds, parts)}
                results[label].append(row)
                print(
                    f"{label:9s} c={c:<3d} {row['throughput_rps']:8.1f} req/s  "
                    f"p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms  "
                    f"errors {row['errors']}  cpu {row['cpu_cores']}",
                    flush=True,
                )

        measure("direct", "ipv4:" + ",".join(workers), [])
        with nginx(tmp, workers) as (address, pid):
            measure("nginx", address, process_tree(pid))
        port = free_port()
        floor = spawn(["benchmarks/bare_proxy.py", ",".join(workers), str(port)], tmp / "floor.log")
        try:
            wait_ready(f"127.0.0.1:{port}")
            measure("python-floor", f"127.0.0.1:{port}", [floor.pid])
        finally:
            floor.terminate()
            floor.wait(10)
        for n in (1, 2):
            address = mesh.start_router("--processes", str(n))
            assert mesh.router is not None and mesh.router.popen is not None
            measure(f"router-{n}", address, process_tree(mesh.router.popen.pid))
            mesh.router.stop()
            mesh.router = None
    finally:
        mesh.stop()
    return results


def summarise(results: dict[str, list[dict]]) -> dict:
    def at(label: str, c: int) -> dict:
        return next(r for r in results[label] if r["concurrency"] == c)

    summary: dict = {}
    for c in CONCURRENCY:
        nginx_row = at("nginx", c)
        row: dict = {
            label: {
                "rps": at(label, c)["throughput_rps"],
                "p50_ms": at(label, c)["p50_ms"],
                "proxy_cpu_us_per_call": at(label, c)["proxy_cpu_us_per_call"],
            }
            for label in results
        }
        floor_row = at("python-floor", c)
        for label in ("python-floor", "router-1", "router-2"):
            r = at(label, c)
            row[f"{label}_over_nginx_rps"] = round(
                r["throughput_rps"] / nginx_row["throughput_rps"], 2
            )
            row[f"{label}_over_nginx_p50"] = round(r["p50_ms"] / nginx_row["p50_ms"], 2)
        for label in ("router-1", "router-2"):
            r = at(label, c)
            row[f"{label}_over_floor_rps"] = round(
                r["throughput_rps"] / floor_row["throughput_rps"], 2
            )
            row[f"{label}_over_floor_p50"] = round(r["p50_ms"] / floor_row["p50_ms"], 2)
        summary[f"c{c}"] = row
    best = {
        c: max(("router-1", "router-2"), key=lambda lb: at(lb, c)["throughput_rps"])
        for c in CONCURRENCY
    }
    summary["target"] = {
        "rule": "router >= 0.9x nginx throughput at c=8 and c=32, p50 within 1.3x",
        "met": all(
            summary[f"c{c}"][f"{best[c]}_over_nginx_rps"] >= 0.9
            and summary[f"c{c}"][f"{best[c]}_over_nginx_p50"] <= 1.3
            for c in (8, 32)
        ),
        "best_router": {f"c{c}": best[c] for c in CONCURRENCY},
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(Path(tmp), args.seconds)
    summary = summarise(results)
    path = write_result(
        "router_scale",
        {
            "benchmark": "router_scale",
            "model": "toy mlp 16->64->4 fp32, batch 1, 2 workers (1 onnxruntime thread each)",
            "client": f"loadtest closed loop, up to {MAX_CONNECTIONS} connections",
            "seconds_per_point": args.seconds,
            "machine": machine(),
            "loadavg": {"before": load_before, "after": os.getloadavg()},
            "results": results,
            "summary": summary,
        },
    )
    print(summary)
    print(f"wrote {path}")


# ---- benchmarks/README.md: this benchmark's section (python -m benchmarks.summary) ----


def section(r: dict) -> str:
    rows = [
        [
            label,
            p["concurrency"],
            p["throughput_rps"],
            p["p50_ms"],
            p["p99_ms"],
            p.get("proxy_cpu_us_per_call"),
            p["cpu_cores"],
        ]
        for label, points in r["results"].items()
        for p in points
    ]
    s = r["summary"]
    ratios = [
        [
            c,
            v.get("python-floor_over_nginx_rps"),
            v["router-1_over_nginx_rps"],
            v["router-2_over_nginx_rps"],
            v.get("router-1_over_floor_rps"),
            v.get("router-2_over_floor_rps"),
            v["router-1_over_nginx_p50"],
            v["router-2_over_nginx_p50"],
        ]
        for c, v in s.items()
        if c.startswith("c")
    ]
    met = "met" if s["target"]["met"] else "not met"
    return "\n\n".join(
        [
            "## Router processes against nginx as a gRPC proxy",
            f"`python -m benchmarks.router_scale` — {r['model']}; {r['client']}, "
            f"{r['seconds_per_point']} s per point. direct: the client balances itself; nginx: "
            "`grpc_pass`, 2 worker processes; python-floor: grpc.aio passing bytes on and "
            "nothing else (benchmarks/bare_proxy.py); router-N: `python -m router --processes "
            "N` with p2c and accounting. CPU in cores per part; proxy CPU per call in us.",
            table(["path", "c", "req/s", "p50 ms", "p99 ms", "proxy us/call", "CPU cores"], rows),
            table(
                [
                    "c",
                    "floor / nginx req/s",
                    "router-1 / nginx req/s",
                    "router-2 / nginx req/s",
                    "router-1 / floor req/s",
                    "router-2 / floor req/s",
                    "router-1 / nginx p50",
                    "router-2 / nginx p50",
                ],
                ratios,
            ),
            f"Target ({s['target']['rule']}): {met}.",
        ]
    )


if __name__ == "__main__":
    main()
