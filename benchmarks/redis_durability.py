"""What Redis's append-only file costs the router: appendfsync everysec against always.

    flock /tmp/meshserve-bench.lock python -m benchmarks.redis_durability [--rounds 3]

One mesh per policy and round (a private redis-server with that policy, one mlp worker, a
router with accounting on and auth off): router p50 at c=1, then throughput at c=32, closed
loops bounded in time. A successful call's reply waits for its batch to be in Redis (group
commit), so with `always` each batch also waits for Redis's fsync. Rounds alternate the
policies; medians over the rounds; the verdict names the policy the numbers favour.
-> benchmarks/results/redis_durability.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import infer_request, machine, write_result
from benchmarks.readings import table
from devmesh import toy_models
from devmesh.processes import LocalMesh
from loadtest.calls import closed_loop

POLICIES = ("everysec", "always")
# `always` is worth its cost when it keeps p50 within this and throughput above this share
P50_BUDGET_MS = 0.5
THROUGHPUT_FLOOR = 0.9


def one_round(policy: str, seconds: float, root: Path) -> dict:
    mesh = LocalMesh(root / f"{policy}-{time.monotonic_ns()}", redis_fsync=policy)
    mesh.worker_args = ("--providers", "cpu", "--intra-op-threads", "1")
    mesh.start_redis()
    try:
        repo = toy_models.build(root / "models")
        mesh.add_worker(repo)
        mesh.wait_registered(1)
        address = mesh.start_router("--no-auth")
        request = infer_request("mlp", "INPUT0", np.ones((1, 16), np.float32), "FP32")
        c1 = asyncio.run(closed_loop(address, request, 1, seconds, warmup=1.0))
        c32 = asyncio.run(closed_loop(address, request, 32, seconds, warmup=1.0))
        return {
            "c1_p50_ms": c1["p50_ms"],
            "c1_p99_ms": c1["p99_ms"],
            "c32_rps": c32["throughput_rps"],
            "c32_p50_ms": c32["p50_ms"],
            "errors": {**c1["errors"], **c32["errors"]},
        }
    finally:
        mesh.stop(kill=True)


def run(rounds: int, seconds: float) -> dict:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    samples: dict[str, list[dict]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="meshserve-aof-") as tmp:
        for i in range(rounds):
            for policy in POLICIES if i % 2 == 0 else reversed(POLICIES):
                samples[policy].append(one_round(policy, seconds, Path(tmp)))
                print(policy, samples[policy][-1], flush=True)
    medians = {
        p: {k: statistics.median(s[k] for s in rows) for k in ("c1_p50_ms", "c32_rps")}
        for p, rows in samples.items()
    }
    added_ms = medians["always"]["c1_p50_ms"] - medians["everysec"]["c1_p50_ms"]
    ratio = medians["always"]["c32_rps"] / medians["everysec"]["c32_rps"]
    always_affordable = added_ms <= P50_BUDGET_MS and ratio >= THROUGHPUT_FLOOR
    return {
        "benchmark": "redis_durability",
        "started": started,
        "machine": machine() | {"shared": True},
        "rounds": rounds,
        "seconds_per_load": seconds,
        "samples": samples,
        "medians": medians,
        "always_added_p50_ms": round(added_ms, 3),
        "always_throughput_ratio": round(ratio, 3),
        "budget": {"p50_ms": P50_BUDGET_MS, "throughput_floor": THROUGHPUT_FLOOR},
        "always_affordable": always_affordable,
        "chosen": "always" if always_affordable else "everysec",
    }


def section(r: dict) -> str:
    m = r["medians"]
    rows = [[p, m[p]["c1_p50_ms"], m[p]["c32_rps"]] for p in POLICIES]
    verdict = (
        f"`always` adds {r['always_added_p50_ms']:g} ms to p50 at c=1 and keeps "
        f"{r['always_throughput_ratio']:.0%} of the throughput at c=32 (budget: "
        f"{r['budget']['p50_ms']:g} ms, {r['budget']['throughput_floor']:.0%}): the mesh "
        f"runs Redis with `appendfsync {r['chosen']}`."
    )
    return "\n\n".join(
        [
            "## Redis durability: appendfsync everysec against always",
            f"`python -m benchmarks.redis_durability` ({r['started']}), medians of "
            f"{r['rounds']} rounds of {r['seconds_per_load']:g} s per load, router with "
            "accounting on; the machine was shared with other work while it ran.",
            table(["appendfsync", "c=1 p50 ms", "c=32 calls/s"], rows),
            verdict,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    result = run(args.rounds, args.seconds)
    print(write_result("redis_durability", result))
    print(section(result))


if __name__ == "__main__":
    main()
