"""Router benchmarks: (a) the cost of the hop, (b) more replicas at a fixed offered load,
(c) balancing policies with one replica slowed on purpose. Plus (d): what forwarding the
request bytes untouched saves over decoding and re-encoding them.

    python -m benchmarks.router [--seconds 6] [--quick]

(b) and (c) use a model whose service time is mostly waiting (`meshserve.simulated_compute_us`,
as an accelerator-bound model would be), because client, router and every worker share this
machine's 2 cores; (b) also runs a compute-bound MLP beside it. Writes
benchmarks/results/router.json and router_replicas.png, router_policies.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    RESULTS,
    check,
    figure,
    free_port,
    infer_request,
    machine,
    model_successes,
    parse,
    spawn,
    wait_ready,
    write_result,
)
from devmesh import toy_models
from devmesh.processes import LocalMesh
from loadtest.calls import closed_loop, open_loop
from protos import grpc_service_pb2 as pb
from protos.routing_pb2 import InferHeader

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")


def config(simulated_us: int, max_batch: int = 1, queue: int = 2000) -> str:
    return (
        f"max_batch_size: {max_batch}\n"
        f"dynamic_batching {{ default_queue_policy {{ max_queue_size: {queue} }} }}\n"
        'parameters { key: "meshserve.simulated_compute_us" '
        f'value {{ string_value: "{simulated_us}" }} }}\n'
    )


def repository(root: Path, name: str, text: str, graph=None) -> Path:  # type: ignore[no-untyped-def]
    toy_models.write(root / name / "mlp", graph or toy_models.mlp(), text)
    return root / name


def small_request() -> pb.ModelInferRequest:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    return infer_request("mlp", "INPUT0", x, "FP32")


def hop(tmp: Path, seconds: float) -> dict:
    """(a) client -> router -> worker against client -> worker, tiny real MLP."""
    mesh = LocalMesh(tmp / "logs-a", worker_args=WORKER_ARGS)
    mesh.start_redis()
    try:
        worker = mesh.add_worker(repository(tmp, "a", config(0, max_batch=64)))
        mesh.wait_registered(1)
        router = mesh.start_router()
        port = free_port()
        proxy = spawn(["benchmarks/bare_proxy.py", worker, str(port)], tmp / "proxy.log")
        wait_ready(f"127.0.0.1:{port}")
        request = small_request()
        out = {}
        paths = (("direct", worker), ("bare_proxy", f"127.0.0.1:{port}"), ("router", router))
        for label, address in paths:
            out[label] = {
                "c1": asyncio.run(closed_loop(address, request, 1, seconds)),
                "c32": asyncio.run(closed_loop(address, request, 32, seconds)),
            }
        out["p50_ratio_c1"] = round(
            out["router"]["c1"]["p50_ms"] / out["direct"]["c1"]["p50_ms"], 2
        )
        out["throughput_ratio_c32"] = round(
            out["router"]["c32"]["throughput_rps"] / out["direct"]["c32"]["throughput_rps"], 2
        )
        out["router_over_bare_proxy_c32"] = round(
            out["router"]["c32"]["throughput_rps"] / out["bare_proxy"]["c32"]["throughput_rps"], 2
        )
        proxy.terminate()
        proxy.wait(10)
        return out
    finally:
        mesh.stop()


def replicas(tmp: Path, seconds: float, label: str, repo: Path, rate: float, request) -> list[dict]:  # type: ignore[no-untyped-def]
    """(b) 1, 2 and 3 workers at one offered load: each worker's share and the latency."""
    rows = []
    for n in (1, 2, 3):
        mesh = LocalMesh(tmp / f"logs-b-{label}-{n}", worker_args=WORKER_ARGS)
        mesh.start_redis()
        try:
            workers = [mesh.add_worker(repo) for _ in range(n)]
            mesh.wait_registered(n)
            router = mesh.start_router()
            result = asyncio.run(open_loop(router, request, rate, seconds))
            served = [model_successes(w, "mlp") for w in workers]
            result.update(
                workers=n,
                per_worker_requests=served,
                per_worker_rps=[round(s / (seconds + 1.0), 1) for s in served],
            )
            rows.append(result)
        finally:
            mesh.stop()
    return rows


def policies(tmp: Path, seconds: float, rate: float) -> list[dict]:
    """(c) three replicas, one 4x slower, at ~80% of the total capacity."""
    fast = repository(tmp, "c-fast", config(4000))
    slow = repository(tmp, "c-slow", config(16000))
    rows = []
    for policy in ("p2c", "least_loaded", "round_robin", "random"):
        mesh = LocalMesh(tmp / f"logs-c-{policy}", worker_args=WORKER_ARGS)
        mesh.start_redis()
        try:
            workers = [mesh.add_worker(fast), mesh.add_worker(fast), mesh.add_worker(slow)]
            mesh.wait_registered(3)
            router = mesh.start_router("--policy", policy)
            result = asyncio.run(open_loop(router, small_request(), rate, seconds))
            served = [model_successes(w, "mlp") for w in workers]
            result.update(policy=policy, slow_share=round(served[2] / max(1, sum(served)), 3))
            rows.append(result)
        finally:
            mesh.stop()
    return rows


def reencode(n: int = 2000) -> dict:
    """(d) the router's per-request parsing: header only (what it does) vs full decode+encode."""
    out = {}
    for label, floats in (("4KiB", 1024), ("1MiB", 262144)):
        x = np.ones((1, floats), np.float32)
        raw = infer_request("mlp", "INPUT0", x, "FP32").SerializeToString()
        t0 = time.perf_counter()
        for _ in range(n):
            InferHeader.FromString(raw)
        header_us = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            pb.ModelInferRequest.FromString(raw).SerializeToString()
        full_us = (time.perf_counter() - t0) / n * 1e6
        out[label] = {"header_parse_us": round(header_us, 2), "decode_encode_us": round(full_us, 2)}
    return out


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in result["replicas"].items():
        n = [r["workers"] for r in rows]
        axes[0].plot(n, [r["p50_ms"] for r in rows], "o-", label=f"{label} p50")
        axes[0].plot(n, [r["p99_ms"] for r in rows], "s--", label=f"{label} p99")
        axes[1].plot(n, [statistics.mean(r["per_worker_rps"]) for r in rows], "o-", label=label)
    axes[0].set(
        xlabel="workers",
        ylabel="latency (ms)",
        yscale="log",
        xticks=[1, 2, 3],
        title="Latency at a fixed offered load",
    )
    axes[1].set(
        xlabel="workers", ylabel="requests/s per worker", xticks=[1, 2, 3], title="Load per machine"
    )
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "router_replicas.png", dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["policies"]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["p50_ms"] for r in rows], 0.4, label="p50")
    ax.bar(x + 0.2, [r["p99_ms"] for r in rows], 0.4, label="p99")
    ax.set_xticks(x, [f"{r['policy']}\nslow got {r['slow_share']:.0%}" for r in rows])
    ax.set(ylabel="latency (ms)", yscale="log", title="One replica 4x slower, ~80% load")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(RESULTS / "router_policies.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parse(parser, seconds=1.0)  # and no plots
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        waiting = repository(tmp, "b-wait", config(4000))
        heavy_graph = toy_models.mlp(hidden=8192, features=1024, classes=16)
        heavy = repository(tmp, "b-compute", config(0), heavy_graph)
        heavy_x = np.random.default_rng(0).standard_normal((1, 1024)).astype(np.float32)
        result = {
            "benchmark": "router",
            "machine": machine(),
            "seconds_per_point": args.seconds,
            "hop": hop(tmp, args.seconds),
            "replicas": {
                "waiting 4 ms @180 rps": replicas(
                    tmp, args.seconds, "wait", waiting, 180, small_request()
                ),
                "compute-bound MLP @150 rps": replicas(
                    tmp,
                    args.seconds,
                    "compute",
                    heavy,
                    150,
                    infer_request("mlp", "INPUT0", heavy_x, "FP32"),
                ),
            },
            "policies": policies(tmp, args.seconds, rate=450),
            "reencode": reencode(),
        }
    by = {r["policy"]: r for r in result["policies"]}
    result["ratios"] = {
        "hop_p50_ratio_c1": result["hop"]["p50_ratio_c1"],
        "hop_throughput_ratio_c32": result["hop"]["throughput_ratio_c32"],
        "router_over_bare_proxy_c32": result["hop"]["router_over_bare_proxy_c32"],
        "p2c_p99_over_random_p99": round(by["p2c"]["p99_ms"] / by["random"]["p99_ms"], 3),
    }
    path = write_result("router", result, TITLE, rows(result), args.quick)
    if not args.quick:
        plot(result)
    print(f"wrote {path}")
    print(result["ratios"])


TITLE = "Router: the hop, replicas, policies"
HOP_P50_TARGET = 1.5  # router p50 at c=1 at most 1.5x direct
HOP_THROUGHPUT_TARGET = 0.9  # router throughput at c=32 at least 0.9x direct


def rows(r: dict) -> list[list]:
    """Headline rows: the hop against its targets, the router against a bare proxy, p2c
    against random with one slow replica."""
    s = r["ratios"]
    return [
        check("router p50 / direct at c=1", s["hop_p50_ratio_c1"], HOP_P50_TARGET, True, "x"),
        check(
            "router req/s / direct at c=32",
            s["hop_throughput_ratio_c32"],
            HOP_THROUGHPUT_TARGET,
            False,
            "x",
        ),
        figure("router req/s / bare grpc.aio proxy at c=32", s["router_over_bare_proxy_c32"], "x"),
        check(
            "p2c p99 / random p99, one replica 4x slower",
            s["p2c_p99_over_random_p99"],
            1.0,
            True,
            "x",
        ),
    ]


if __name__ == "__main__":
    main()
