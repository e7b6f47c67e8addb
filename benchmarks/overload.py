"""Overload and fairness on a real mesh (issue 48, items 2-4): SmolLM2 (int8) in one worker
with `--slots` sequences at once, three routers over it, and the load tool driving them.

    python -m benchmarks.overload [--seconds 30] [--slots 4] [--bound 3] [--quick]

- capacity: a closed loop of 2 x slots callers (no bound): the requests/s the worker
  finishes; it also gives the worker its measured service rate, which the routers read.
- (a) overload: Poisson arrivals at 3x that capacity through the router with
  `--queue-wait-bound-seconds --bound`: the accepted requests' TTFT p99 against the bound,
  how many were shed and whether each got Retry-After, and the ledger's counts for that
  tenant against what the client saw (calls sent, succeeded, shed: none lost).
- (b) two tenants through a router with keys (the engine's fair admission) and the same
  load through a router with --no-auth (every request the one default tenant: first come,
  first served): light alone (1 caller, once the engine drained), then heavy with 10
  callers and light's 1 joining a sixth of a phase later (a new key on an engine heavy
  fills; both measured from then on): the light tenant's TTFT p99 against alone; then
  both backlogged (heavy 10 x slots callers, light 1 x slots): Jain's index of the two
  tenants' served tokens (prompt + completion).

Every request is a ~32-token prompt and 32 generated tokens (ignore_eos). Bounded: six
phases of `--seconds` each plus their drains, a few minutes in all on a 2-core VM (the
machine is shared; figures from one run). Writes benchmarks/results/overload.json with the
summary block (benchmarks/summary.py); `--quick` (10 s phases) writes build/bench-quick/ instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.common import ROOT, machine, parse, write_result
from common import mesh_state, model_keys
from common.mesh_state import DepthSample
from common.tenancy import TenantPolicy
from devmesh.processes import LocalMesh
from ledger.store import Store
from loadtest.llm import prompts as prompt_source
from loadtest.llm.runner import LLMLoad, closed_loop, open_loop
from loadtest.llm.tenants import TenantLoad, run_tenants
from quantize import llm

MODEL = "smollm2"
WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "2", "--heartbeat-seconds", "0.2")
TOKENS = 32
LIGHT_TTFT_TARGET = 1.5  # light's TTFT p99 with heavy beside it, at most this x alone
JAIN_TARGET = 0.95
# light joins heavy's load this far into it (of a phase's seconds): a new tenant on an
# engine another fills, measured from its first request on, as heavy's warm-up ends
LIGHT_JOINS = 1 / 6
OVERLOAD = 3.0  # x capacity
TITLE = "Overload (shedding by predicted wait) and two tenants (fair admission), SmolLM2"


def repository(root: Path, slots: int) -> Path:
    slots_key = {model_keys.MAX_NUM_SEQS: str(slots)}
    llm.build(root, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize", parameters=slots_key)
    return root


class Bench:
    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.mesh = LocalMesh(tmp / "logs", worker_args=WORKER_ARGS)
        self.mesh.auth = True
        self.mesh.start_redis()
        self.mesh.add_worker(repository(tmp / "repo", args.slots))
        self.mesh.wait_registered(1, timeout=180)
        self.fair = self.router()
        self.fifo = self.router("--no-auth")
        self.bounded = self.router("--queue-wait-bound-seconds", str(args.bound))
        self.mesh.start_ledger()
        self.store = Store(self.mesh.ledger_db)
        sizes = prompt_source.lengths(TOKENS, 0, 32, seed=1)
        self.load = LLMLoad(
            self.fair,
            MODEL,
            prompt_source.synthetic(sizes, seed=1),
            TOKENS,
            sampling={"temperature": 0, "ignore_eos": True},
            duration=args.seconds,
            timeout=300,
            progress_seconds=5.0,
        )

    def router(self, *extra: str) -> str:
        address, process = self.mesh.spawn_router("--auth-cache-seconds", "0.5", *extra)
        self.mesh.others.append(process)
        return address

    def key(self, tenant: str) -> str:
        """A tenant's key, also in the environment variable the load tool reads."""
        admin = self.mesh.tenant_admin()
        admin.set_tenant(tenant, TenantPolicy())
        key = admin.create_key(tenant)[1]
        os.environ[f"BENCH_{tenant.upper()}_KEY"] = key
        return key

    def at(self, address: str, tenant: str | None = None) -> LLMLoad:
        return replace(self.load, address=address, api_key=self.key(tenant) if tenant else None)

    def stop(self) -> None:
        self.mesh.stop(kill=True)


def _print(line: str, final: bool) -> None:
    print(line, flush=True)


def capacity(b: Bench) -> dict:
    """Warm up, then the worker saturated: requests/s it finishes."""
    asyncio.run(closed_loop(replace(b.at(b.fair, "warm"), duration=10.0), b.args.slots))
    run = asyncio.run(closed_loop(b.at(b.fair, "probe"), 2 * b.args.slots, _print))
    return {"closed_loop_callers": 2 * b.args.slots, **_brief(run)}


def overload(b: Bench, rate: float) -> dict:
    load = b.at(b.bounded, "overload")
    run = asyncio.run(open_loop(load, rate, seed=3, progress=_print))
    time.sleep(3.0)  # the router's last batches reach the ledger
    usage = b.store.tenant_usage().get(("overload", MODEL), {})
    shed = sum(n for (_, _, t), n in b.store.shed().items() if t == "overload")
    client_shed = run["shed"]["count"]
    ledger = {
        "calls": usage.get("calls", 0),
        "success": usage.get("success", 0),
        "errors": usage.get("errors", 0),
        "shed": shed,
        "completion_tokens": usage.get("completion_tokens", 0),
        "revenue_micro_usd": usage.get("revenue_micro_usd", 0),
    }
    return {
        "offered_rps": rate,
        "bound_s": b.args.bound,
        "sent": run["sent"],
        "accepted": run["requests"],
        "errors": run["errors"],
        "shed": run["shed"],
        "ttft_ms": run["ttft_ms"],
        "output_tokens": run["output_tokens"],
        "client_limited": run["client_limited"],
        "ledger": ledger,
        "ledger_matches": (
            ledger["calls"] == run["sent"]
            and ledger["success"] == run["requests"]
            and ledger["shed"] == client_shed
            and ledger["completion_tokens"] == run["output_tokens"]
        ),
    }


def drained(b: Bench, timeout: float = 120.0) -> None:
    """Until the worker runs and queues nothing (its depth sample), so that a phase starts
    on a quiet engine, not behind the last phase's requests."""
    client = b.mesh.redis_client()
    workers: list[str] = client.zrange(mesh_state.WORKERS, 0, -1)  # type: ignore[assignment]
    key = mesh_state.depth_key(workers[0])
    deadline = time.monotonic() + timeout
    while DepthSample.decode(client.get(key)).depth > 0:  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not drain within {timeout:g} s")
        time.sleep(0.1)
    time.sleep(0.5)


def tenants(b: Bench, address: str, heavy: int, light: int, tag: str, after: float = 0.0) -> dict:
    """Heavy's and light's closed loops, light starting `after` s into heavy's."""
    b.key(f"heavy{tag}")
    b.key(f"light{tag}")
    loads = [
        TenantLoad("heavy", f"BENCH_HEAVY{tag.upper()}_KEY", concurrency=heavy),
        TenantLoad("light", f"BENCH_LIGHT{tag.upper()}_KEY", concurrency=light, after=after),
    ]
    result = asyncio.run(run_tenants(replace(b.load, address=address), loads, progress=_print))
    return {
        "heavy_callers": heavy,
        "light_callers": light,
        "light_after_s": after,
        "served_tokens": result["served_tokens"],
        "jain": result["jain"],
        "tenants": {name: _brief(r) for name, r in result["tenants"].items()},
        # light's requests, in start order: [start s, TTFT ms], where its tail is
        "light_ttft_ms": [
            [row["start_s"], row.get("ttft_ms")]
            for row in result["tenants"]["light"]["per_request"]
        ],
    }


def _brief(run: dict) -> dict:
    keys = ("requests", "errors", "throughput_rps", "output_tokens", "prompt_tokens_total")
    return {**{k: run[k] for k in keys}, "ttft_ms": run["ttft_ms"], "shed": run["shed"]}


def main() -> None:
    args = _parse_args()
    result: dict = {"machine": machine(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        b = Bench(Path(tmp), args)
        try:
            result["capacity"] = capacity(b)
            rate = round(OVERLOAD * result["capacity"]["throughput_rps"], 2)
            result["overload"] = overload(b, rate)
            drained(b)
            alone = asyncio.run(closed_loop(b.at(b.fair, "alone"), 1, _print))
            result["light_alone"] = _brief(alone)
            join = LIGHT_JOINS * args.seconds
            result["ten_to_one"] = {
                "fair": tenants(b, b.fair, 10, 1, "a", after=join),
                "fifo": tenants(b, b.fifo, 10, 1, "b", after=join),
            }
            drained(b)
            s = args.slots
            result["backlogged"] = {
                "fair": tenants(b, b.fair, 10 * s, s, "c"),
                "fifo": tenants(b, b.fifo, 10 * s, s, "d"),
            }
        finally:
            b.stop()
    table = rows(result, args)
    path = write_result("overload", result, TITLE, table, args.quick)
    for row in table:
        print(" | ".join(str(x) for x in row))
    print(f"wrote {path}")


def rows(r: dict, args: argparse.Namespace) -> list[list]:
    o = r["overload"]
    p99 = (o["ttft_ms"]["p99"] or 0) / 1000
    shed = o["shed"]
    alone = (r["light_alone"]["ttft_ms"]["p99"] or 0) / 1000
    rows = [
        ["capacity (req/s, saturated)", r["capacity"]["throughput_rps"], "", ""],
        [
            f"overload {OVERLOAD:g}x: accepted TTFT p99 (s)",
            round(p99, 3),
            f"<= {args.bound:g}",
            _verdict(p99 <= args.bound),
        ],
        [
            "overload: shed, with Retry-After",
            f"{shed['count']}, {shed['with_retry_after']}",
            "every shed one",
            _verdict(shed["count"] > 0 and shed["with_retry_after"] == shed["count"]),
        ],
        [
            "overload: ledger = client (calls, success, shed, tokens)",
            f"{o['ledger']['calls']}/{o['sent']}, {o['ledger']['shed']}/{shed['count']}",
            "none lost",
            _verdict(o["ledger_matches"]),
        ],
    ]
    for policy in ("fair", "fifo"):
        light = r["ten_to_one"][policy]["tenants"]["light"]["ttft_ms"]["p99"] or 0
        ratio = round(light / 1000 / alone, 2) if alone else None
        met = ratio is not None and ratio <= LIGHT_TTFT_TARGET
        target = f"<= {LIGHT_TTFT_TARGET:g}" if policy == "fair" else ""
        label = f"10:1, {policy}: light TTFT p99 / alone ({alone:.3f} s)"
        rows.append([label, ratio, target, _verdict(met) if target else ""])
        if policy == "fair":  # the middle, where the p99 of ~40 requests is their worst
            p50 = r["ten_to_one"][policy]["tenants"]["light"]["ttft_ms"]["p50"] or 0
            alone_p50 = r["light_alone"]["ttft_ms"]["p50"] or 0
            ratio50 = round(p50 / alone_p50, 2) if alone_p50 else None
            rows.append(
                [f"10:1, fair: light TTFT p50 / alone ({alone_p50 / 1000:.3f} s)", ratio50, "", ""]
            )
    for policy in ("fair", "fifo"):
        index = r["backlogged"][policy]["jain"]
        met = index is not None and index >= JAIN_TARGET
        target = f">= {JAIN_TARGET:g}" if policy == "fair" else ""
        label = f"backlogged 10:1, {policy}: Jain's index of served tokens"
        rows.append([label, index, target, _verdict(met) if target else ""])
    return rows


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="each phase's window")
    parser.add_argument("--slots", type=int, default=4, help="the worker's max_num_seqs")
    parser.add_argument("--bound", type=float, default=3.0, help="queue-wait bound (s)")
    return parse(parser, seconds=10.0)


if __name__ == "__main__":
    main()
