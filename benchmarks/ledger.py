"""The cost of exact accounting, and the ledger's economics after a real load run.

    python -m benchmarks.ledger [--pairs 8] [--seconds 5] [--skip-economics] [--quick]

(1) Router saturation throughput (closed loop, c=32, tiny MLP, 2 workers) with accounting on
    (group commit: a success is answered once its record is in Redis) and off
    (`--no-accounting`), in `--pairs` pairs run back to back, the order alternating (on-off,
    off-on, ...) so drift hits both alike. The cost is 1 - on/off per pair; it is reported
    as the median with IQR and range, and a sign test says whether it is distinguishable
    from run-to-run noise (6 pairs, all one way, are the fewest that can be).
(2) A mesh with the ledger process under waves of load: the durable N against the calls the
    client saw succeed, and the report (JSON) and its plot.
Writes benchmarks/results/ledger.json and ledger.png. `--quick`: 3 pairs of 2 s, no
economics run, written to build/bench-quick/.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import readings
from benchmarks.common import RESULTS, figure, infer_request, machine, parse, write_result
from devmesh import toy_models
from devmesh.processes import LocalMesh
from ledger import config as ledger_config
from ledger import report
from ledger.store import Store
from loadtest.calls import closed_loop

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
CONFIG = (
    "max_batch_size: 64\ndynamic_batching { }\n"
    'parameters { key: "meshserve.price_per_call_micro_usd" value { string_value: "100" } }\n'
    'parameters { key: "meshserve.training_cost_micro_usd" value { string_value: "5000000000" } }\n'
)


def request():  # type: ignore[no-untyped-def]
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    return infer_request("mlp", "INPUT0", x, "FP32")


def accounting_cost(repo: Path, tmp: Path, seconds: float, pairs: int) -> dict:
    mesh = LocalMesh(tmp / "logs-cost", worker_args=WORKER_ARGS)
    mesh.start_redis()
    rows: list[dict] = []
    try:
        mesh.add_worker(repo)
        mesh.add_worker(repo)
        mesh.wait_registered(2)
        for i in range(pairs):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            row: dict = {"order": ", ".join(order)}
            for mode in order:
                extra = () if mode == "on" else ("--no-accounting",)
                address = mesh.start_router(*extra)
                result = asyncio.run(closed_loop(address, request(), 32, seconds))
                row[mode] = result["throughput_rps"]
                assert mesh.router is not None
                mesh.router.stop()
            print(f"pair {i + 1}/{pairs}: {row}", flush=True)
            rows.append(row)
    finally:
        mesh.stop()
    on, off = [r["on"] for r in rows], [r["off"] for r in rows]
    stats = readings.paired_cost(on, off)
    return {
        "pairs": rows,
        "runs_rps": {"on": on, "off": off},
        "on_rps": statistics.median(on),
        "off_rps": statistics.median(off),
        "cost_fraction": stats["median"],
        "paired": stats,
        "reading": readings.accounting_reading(stats),
    }


def economics_run(repo: Path, tmp: Path, plot: Path, waves: int = 4) -> dict:
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
    report.plot(store, config, rows, plot)
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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ledger", description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds a run")
    parser.add_argument("--pairs", type=int, default=8, help="accounting on/off pairs")
    parser.add_argument("--skip-economics", action="store_true")
    args = parse(parser, pairs=3, seconds=2.0, skip_economics=True)
    if args.pairs < 1 or args.seconds <= 0:
        parser.error("--pairs must be >= 1 and --seconds > 0")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        toy_models.write(repo / "mlp", toy_models.mlp(), CONFIG)
        cost = accounting_cost(repo, tmp, args.seconds, args.pairs)
        econ = None if args.skip_economics else economics_run(repo, tmp, RESULTS / "ledger.png")
    payload = {
        "benchmark": "ledger",
        "machine": machine(),
        "seconds_per_point": args.seconds,
        "accounting": cost,
    }
    if econ is not None:
        payload["economics"] = econ
        print(econ["text"])
        print(f"client successes {econ['client_successes']}, durable {econ['durable_calls']}")
    path = write_result("ledger", payload, TITLE, rows(payload), args.quick)
    print(cost["reading"])
    print(f"wrote {path}")


TITLE = "Ledger: what exact accounting costs, and the economics after a load run"


def rows(r: dict) -> list[list]:
    """Headline rows: the cost of accounting and whether it is told apart from noise; the
    durable ledger against the client's successes."""
    a, e = r["accounting"], r.get("economics")
    stats = readings.paired_cost(a["runs_rps"]["on"], a["runs_rps"]["off"])
    out = [
        figure(
            f"accounting on: throughput cost, median of {stats['pairs']} pairs",
            f"{stats['median']:.1%}",
        ),
        figure(
            "cost distinguishable from noise (sign test p)",
            f"{'yes' if stats['distinguishable'] else 'no'} (p = {stats['sign_test_p']})",
        ),
    ]
    if e is not None:
        exact = [
            f"durable calls = client successes ({e['durable_calls']} / {e['client_successes']})"
        ]
        out.append(
            [
                *exact,
                "equal" if e["exact"] else "differ",
                "equal",
                "met" if e["exact"] else "missed",
            ]
        )
    return out


if __name__ == "__main__":
    main()
