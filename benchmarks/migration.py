"""Streams that survive a worker's death (issue 48): kill -9 of one of two workers under 12
concurrent greedy streams through the router.

    python -m benchmarks.migration [--streams 12] [--max-tokens 64] [--kill-after-pieces 3]
        [--quick: 4 streams of 24 tokens, into build/bench-quick/]

Redis, two SmolLM2 int8 workers (one onnxruntime thread each), the router (migration limit
2) and a ledger on SQLite. The load tool's chaos mode (loadtest/llm/chaos.py) runs one
round of `--streams` streams without a kill (the reference), then the same round with the
worker serving most of them (the router's in-flight calls per replica) killed -9 once every
stream has `--kill-after-pieces` pieces. Reported: streams completed / broken / with the
full token count, migrated (the router's counter), with the reference's text, the seconds
each round took, and the ledger's prompt and completion tokens against what the clients
received over both rounds. Target: 12 of 12 complete with the full token count and the
reference's text, ledger tokens = tokens received.
Writes benchmarks/results/migration.json.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import machine, parse, write_result
from devmesh.processes import ROOT, LocalMesh, free_port
from ledger.store import Store
from loadtest.llm.chaos import Kill, chaos_round, same_text
from loadtest.llm.prompts import Prompt
from loadtest.llm.runner import LLMLoad
from quantize import llm

MODEL = "smollm2"
WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1", "--heartbeat-seconds", "0.2")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kill-after-pieces", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="bounds each stream")
    return parse(p, streams=4, max_tokens=24)


def busiest(mesh: LocalMesh, metrics_port: int) -> int:
    """The pid of the worker with the most calls in flight from the router."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()

    def inflight(address: str) -> float:
        host, port = address.rsplit(":", 1)
        label = f'meshserve_router_inflight{{worker="worker-{host}-{port}"}} '
        line = next((x for x in text.splitlines() if x.startswith(label)), label + "0")
        return float(line.rsplit(" ", 1)[1])

    address = max((a for a, p in mesh.workers.items() if p.alive), key=inflight)
    popen = mesh.workers[address].popen
    assert popen is not None
    return popen.pid


def ledger_tokens(store: Store, expected: tuple[int, int], timeout: float = 30.0) -> tuple:
    """The LLM's (prompt, completion) tokens in the ledger once they equal `expected` (or at
    `timeout`), and a second later: nothing more may arrive."""
    deadline = time.monotonic() + timeout

    def read() -> tuple[int, int]:
        rows = [v for (m, _), v in store.usage().items() if m == MODEL]
        return sum(v["prompt_tokens"] for v in rows), sum(v["completion_tokens"] for v in rows)

    while read() != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    return read()


async def rounds(mesh: LocalMesh, metrics_port: int, args: argparse.Namespace) -> dict:
    prompts = [
        Prompt(f"Story {i}: the lighthouse keeper number {i} looked at the sea and")
        for i in range(args.streams)
    ]
    load = LLMLoad(
        mesh.router_address,
        MODEL,
        prompts,
        args.max_tokens,
        sampling={"temperature": 0, "ignore_eos": True},
        timeout=args.timeout,
    )
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    reference = await chaos_round(load, args.streams, None, url)
    kill = Kill(lambda: busiest(mesh, metrics_port), signal.SIGKILL, args.kill_after_pieces)
    chaos = await chaos_round(load, args.streams, kill, url)
    chaos["same_text_as_reference"] = same_text(reference, chaos)
    return {"reference": reference, "chaos": chaos}


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        llm.build(tmp / "repo", llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
        mesh = LocalMesh(tmp / "logs", worker_args=WORKER_ARGS)
        store = Store(f"sqlite:///{tmp / 'ledger.db'}")
        try:
            mesh.start_redis()
            for _ in range(2):
                mesh.add_worker(tmp / "repo")
            mesh.wait_registered(2)
            metrics_port = free_port()
            mesh.start_router("--stall-seconds", "0.5", "--metrics-port", str(metrics_port))
            mesh.start_ledger(store.url, "--interval-seconds", "0.1")
            result = asyncio.run(rounds(mesh, metrics_port, args))
            both = (result["reference"], result["chaos"])
            received = (
                sum(r["prompt_tokens_received"] for r in both),
                sum(r["completion_tokens_received"] for r in both),
            )
            result["ledger"] = {
                "received": list(received),
                "billed": list(ledger_tokens(store, received)),
            }
        finally:
            mesh.stop(kill=True)
            store.close()
    return result


def rows(result: dict) -> list[list]:
    """The headline rows, each verdict from the figures."""
    c, ledger = result["chaos"], result["ledger"]
    n = c["streams"]

    def row(label: str, value: int, met: bool) -> list:
        return [label, f"{value}/{n}", f"{n}/{n}", "met" if met else "missed"]

    billed, received = ledger["billed"], ledger["received"]
    return [
        row("streams complete", c["completed"], c["completed"] == n),
        row("with the full token count", c["full_token_count"], c["full_token_count"] == n),
        row(
            "greedy text equal to an uninterrupted run",
            c["same_text_as_reference"],
            c["same_text_as_reference"] == n,
        ),
        ["streams migrated", c["migrated"], "", ""],
        [
            "ledger tokens (prompt, completion) = received",
            f"{billed} / {received}",
            "equal",
            "met" if billed == received else "missed",
        ],
        [
            "round seconds, uninterrupted / with the kill",
            f"{result['reference']['seconds']} / {c['seconds']}",
            "",
            "",
        ],
    ]


def main() -> int:
    args = _args()
    result = measure(args)
    payload = {
        "benchmark": "migration",
        "machine": {**machine(), "note": "shared 2-core VM, other jobs running: noisy"},
        "setup": {**vars(args), "workers": 2, "migration_limit": 2, "model": MODEL},
        **result,
    }
    headline = rows(result)
    title = f"kill -9 of one of two workers under {args.streams} streams"
    path = write_result("migration", payload, title, headline, args.quick)
    for label, value, target, verdict in headline:
        print(f"{label:48s} {value!s:>24s}  {target!s:>8s}  {verdict}")
    print(f"wrote {path}")
    return 0 if all(r[3] != "missed" for r in headline) else 1


if __name__ == "__main__":
    raise SystemExit(main())
