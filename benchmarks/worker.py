"""Worker throughput and latency on a tiny MLP: batching on vs off, against a bare server,
and the batching delay (500 us, the toy `mlp`'s) applied only while a batch runs (now)
against waiting it out even when idle (before: `meshserve.batch_delay_when_idle`).

    python -m benchmarks.worker [--seconds 5] [--rounds 3] [--quick]

Client, server and onnxruntime share this machine's cores; the load generator is a
closed loop (each of C callers sends its next request when the last one returns).
Writes benchmarks/results/worker.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.common import (
    check,
    figure,
    free_port,
    infer_request,
    machine,
    parse,
    print_points,
    spawn,
    standalone_worker,
    wait_ready,
    write_result,
)
from devmesh import toy_models
from loadtest.calls import closed_loop

DELAY_500US = "max_batch_size: 64\ndynamic_batching { max_queue_delay_microseconds: 500 }\n"
CONFIGS = {
    "mlp_batching": "max_batch_size: 64\ndynamic_batching { max_queue_delay_microseconds: 0 }\n",
    "mlp_no_batching": "max_batch_size: 64\n",
    "mlp_delay_500us": DELAY_500US,
    "mlp_delay_500us_when_idle": DELAY_500US
    + 'parameters { key: "meshserve.batch_delay_when_idle" value { string_value: "true" } }\n',
}
CONCURRENCY = [1, 8, 32]


def point(address: str, model: str, c: int, seconds: float) -> dict:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    request = infer_request(model, "INPUT0", x, "FP32")
    return asyncio.run(closed_loop(address, request, c, seconds))


def median_of(rounds: list[dict]) -> dict:
    """One point from several rounds: the median throughput and percentiles (the machine is
    shared: rounds interleave the targets so that a busy minute hits them all alike)."""
    out = dict(rounds[len(rounds) // 2])
    for key in ("throughput_rps", "p50_ms", "p99_ms"):
        out[key] = round(statistics.median(r[key] for r in rounds), 3)
    out["rounds"] = [{k: r[k] for k in ("throughput_rps", "p50_ms", "p99_ms")} for r in rounds]
    out.pop("cdf", None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0, help="per point and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parse(parser, seconds=1.0, rounds=1)
    results = _measure(args.seconds, args.rounds)
    payload = {
        "benchmark": "worker",
        "model": "tiny MLP 16->64->4 fp32, batch 1 per request",
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
        "aggregate": "median over rounds; each round runs every target at each concurrency",
        "machine": machine(),
        "results": results,
        "ratios": _ratios(results),
    }
    path = write_result("worker", payload, TITLE, rows(payload), args.quick)
    print_points(results)
    print(f"wrote {path}")


def _measure(seconds: float, rounds: int) -> dict[str, list[dict]]:
    """Every worker config and the bare server at each concurrency, `rounds` times
    interleaved; per target, one median point per concurrency."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        for name, config in CONFIGS.items():
            toy_models.write(repo / name, toy_models.mlp(), config)
        raw: dict[tuple[str, int], list[dict]] = defaultdict(list)

        worker_args = ("--providers", "cpu", "--intra-op-threads", "1")
        port = free_port()
        bare = spawn(
            ["benchmarks/bare_server.py", str(repo / "mlp_no_batching/1/model.onnx"), str(port)],
            Path(tmp) / "bare.log",
        )
        try:
            wait_ready(f"127.0.0.1:{port}")
            with standalone_worker(repo, Path(tmp), *worker_args) as address:
                targets = [(f"worker/{m}", address, m) for m in CONFIGS]
                targets.append(("bare_grpc_aio", f"127.0.0.1:{port}", "mlp"))
                for _ in range(rounds):
                    for c in CONCURRENCY:
                        for key, where, model in targets:
                            raw[(key, c)].append(point(where, model, c, seconds))
        finally:
            bare.terminate()
            bare.wait(30)
        results: dict[str, list[dict]] = defaultdict(list)
        for (key, _c), points in raw.items():
            results[key].append(median_of(points))
    return results


def _ratios(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per concurrency, batching against none and against the bare server, and the delay
    while a batch runs against waiting it out when idle; and whether the target is met."""

    def at(key: str, c: int) -> dict:
        return next(r for r in results[key] if r["concurrency"] == c)

    summary: dict[str, dict] = {
        f"c{c}": {
            "batching_rps": at("worker/mlp_batching", c)["throughput_rps"],
            "no_batching_rps": at("worker/mlp_no_batching", c)["throughput_rps"],
            "bare_rps": at("bare_grpc_aio", c)["throughput_rps"],
            "batching_over_bare": round(
                at("worker/mlp_batching", c)["throughput_rps"]
                / at("bare_grpc_aio", c)["throughput_rps"],
                2,
            ),
            "delay_rps": at("worker/mlp_delay_500us", c)["throughput_rps"],
            "delay_when_idle_rps": at("worker/mlp_delay_500us_when_idle", c)["throughput_rps"],
            "delay_p50_ms": at("worker/mlp_delay_500us", c)["p50_ms"],
            "delay_when_idle_p50_ms": at("worker/mlp_delay_500us_when_idle", c)["p50_ms"],
            "bare_p50_ms": at("bare_grpc_aio", c)["p50_ms"],
            "delay_p50_over_bare": round(
                at("worker/mlp_delay_500us", c)["p50_ms"] / at("bare_grpc_aio", c)["p50_ms"], 2
            ),
            "delay_rps_over_when_idle": round(
                at("worker/mlp_delay_500us", c)["throughput_rps"]
                / at("worker/mlp_delay_500us_when_idle", c)["throughput_rps"],
                2,
            ),
        }
        for c in CONCURRENCY
    }
    summary["target"] = {
        "rule": "500 us delay: c=1 p50 within 1.2x of bare grpc.aio; c=32 throughput not "
        "below waiting out the delay when idle (the rule before)",
        "met": summary["c1"]["delay_p50_over_bare"] <= 1.2
        and summary["c32"]["delay_rps_over_when_idle"] >= 1.0,
    }
    return summary


TITLE = "Worker: tiny MLP, batching on vs off, against a bare grpc.aio server"


def rows(r: dict) -> list[list]:
    """Headline rows: batching against the bare server, and the 500 us delay's targets."""
    s = r["ratios"]
    return [
        figure("batching req/s at c=32", s["c32"]["batching_rps"]),
        figure("batching / bare grpc.aio req/s at c=1", s["c1"]["batching_over_bare"], "x"),
        figure("batching / bare grpc.aio req/s at c=32", s["c32"]["batching_over_bare"], "x"),
        check("500 us delay: p50 / bare at c=1", s["c1"]["delay_p50_over_bare"], 1.2, True, "x"),
        check(
            "500 us delay: req/s / waiting when idle at c=32",
            s["c32"]["delay_rps_over_when_idle"],
            1.0,
            False,
            "x",
        ),
    ]


if __name__ == "__main__":
    main()
