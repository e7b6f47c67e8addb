"""The cost of exact accounting, and the ledger's economics after a real load run.

    python -m benchmarks.ledger [--seconds 5]

(1) Router saturation throughput (closed loop, c=32, tiny MLP, 2 workers) with accounting on
    (group commit: a success is answered once its record is in Redis) and off
    (`--no-accounting`), alternated twice; medians compared.
(2) A mesh with the ledger process under waves of load: the durable N against the calls the
    client saw succeed, and the report (JSON) and its plot.
Writes benchmarks/results/ledger.json and ledger.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, closed_loop, infer_request, machine, write_result
from deploy import toy_models
from deploy.processes import LocalMesh
from ledger import config as ledger_config
from ledger import report
from ledger.store import Store

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
CONFIG = (
    "max_batch_size: 64\ndynamic_batching { }\n"
    'parameters { key: "meshserve.price_per_call_micro_usd" value { string_value: "100" } }\n'
    'parameters { key: "meshserve.training_cost_micro_usd" value { string_value: "5000000000" } }\n'
)


def request():  # type: ignore[no-untyped-def]
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    return infer_request("mlp", "INPUT0", x, "FP32")


def accounting_cost(tmp: Path, seconds: float) -> dict:
    repo = tmp / "repo"
    toy_models.write(repo / "mlp", toy_models.mlp(), CONFIG)
    mesh = LocalMesh(tmp / "logs-cost", worker_args=WORKER_ARGS)
    mesh.start_redis()
    runs: dict[str, list[float]] = {"on": [], "off": []}
    try:
        mesh.add_worker(repo)
        mesh.add_worker(repo)
        mesh.wait_registered(2)
        for _ in range(2):
            for mode in ("on", "off"):
                extra = () if mode == "on" else ("--no-accounting",)
                address = mesh.start_router(*extra)
                result = asyncio.run(closed_loop(address, request(), 32, seconds))
                runs[mode].append(result["throughput_rps"])
                assert mesh.router is not None
                mesh.router.stop()
    finally:
        mesh.stop()
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    return {"runs_rps": runs, "on_rps": on, "off_rps": off, "cost_fraction": round(1 - on / off, 4)}


def economics_run(tmp: Path, waves: int = 4) -> dict:
    repo = tmp / "repo"
    mesh = LocalMesh(tmp / "logs-econ", worker_args=WORKER_ARGS)
    mesh.start_redis()
    db = f"sqlite:///{tmp / 'ledger.db'}"
    ok = 0
    try:
        mesh.add_worker(repo)
        mesh.add_worker(repo)
        mesh.wait_registered(2)
        router = mesh.start_router()
        mesh.start_ledger(db, "--interval-seconds", "0.5")
        for wave in range(waves):  # growing waves, 10 s apart: one time bucket each
            result = asyncio.run(
                closed_loop(router, request(), 8, 2.0, warmup=0, max_requests=1000 * (wave + 1))
            )
            ok += result["requests"]
            time.sleep(8.0)
    finally:
        mesh.stop()  # router, workers, then the ledger's last pass
    store = Store(db)
    config = ledger_config.load(None)
    rows = report.build(store, config)
    report.plot(store, config, rows, RESULTS / "ledger.png")
    store.close()
    (mlp,) = rows
    return {
        "client_successes": ok,
        "durable_calls": mlp.calls,
        "exact": mlp.calls == ok and mlp.revenue_micro_usd == ok * 100,
        "report": mlp.as_dict(),
        "text": report.text(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cost = accounting_cost(tmp, args.seconds)
        econ = economics_run(tmp)
    path = write_result(
        "ledger",
        {
            "benchmark": "ledger",
            "machine": machine(),
            "seconds_per_point": args.seconds,
            "accounting": cost,
            "economics": econ,
        },
    )
    print(econ["text"])
    print(
        f"accounting on {cost['on_rps']} rps, off {cost['off_rps']} rps "
        f"-> cost {cost['cost_fraction']:.1%}; exact: {econ['exact']}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
