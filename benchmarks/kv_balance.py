"""KV-aware p2c vs plain p2c, with one replica's KV cache nearly full.

Two SmolLM2 worker replicas with a small KV budget each (`--kv-tokens`). Before each
policy's phase a long generation is pinned directly on replica A (prompt + max_tokens close
to A's whole budget), so A reports a short queue (one sequence) but has no room: a request
sent there waits for admission until the long generation ends. Then a closed loop of short
requests goes through a router running the policy, and the load tool measures time to first
token. Plain p2c (`p2c_depth`) sees A's queue of one and sends it part of the load; KV-aware
p2c (`p2c`) sees its cache full and sends everything to B.

TTFT here is the time to the first non-empty response: where the router answers a decoupled
model's stream request with the whole text in one message (before streaming forwarding
lands), it includes the short requests' few decode steps.

    python -m benchmarks.kv_balance [--seconds 20] [--concurrency 4]

writes benchmarks/results/kv_balance.json.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.common import ROOT, machine, model_successes, write_result
from benchmarks.readings import table
from devmesh.processes import LocalMesh
from loadtest.llm import prompts as prompt_source
from loadtest.llm.runner import LLMLoad, closed_loop
from loadtest.llm.stream import Streams, build_request
from quantize import llm

MODEL = "smollm2"
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: K and V x layers x kv heads x dim, fp32
WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1", "--heartbeat-seconds", "0.2")


def small_kv_repository(root: Path, kv_tokens: int) -> Path:
    """The SmolLM2 repository with a KV budget of `kv_tokens` tokens per replica."""
    llm.build(root, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
    config = root / MODEL / "config.pbtxt"
    text = config.read_text()
    config.unlink()  # a fresh file: the built one may be linked to the build cache
    config.write_text(
        text + 'parameters { key: "meshserve.kv_cache_bytes" value { string_value: '
        f'"{kv_tokens * KV_BYTES_PER_TOKEN}" }} }}\n'
    )
    return root


def kv_sample(client: redis.Redis, worker_id: str) -> tuple[int, int, int]:
    """(depth, kv_used, kv_total) the worker last published."""
    raw = client.get(f"meshserve:depth:{worker_id}")
    parts = [int(p) for p in str(raw).split(":")]
    return parts[0], parts[2], parts[3]


def worker_id(address: str) -> str:
    host, port = address.rsplit(":", 1)
    return f"worker-{host}-{port}"


async def phase(
    mesh: LocalMesh, policy: str, a: str, b: str, args: argparse.Namespace, load: LLMLoad
) -> dict:
    client = mesh.redis_client()
    router = mesh.start_router("--policy", policy, "--poll-seconds", "0.02")
    pinned_streams = Streams(a)
    pinned_request = build_request(
        MODEL,
        "Tell me a very long story about the sea.",
        {"max_tokens": args.pinned_tokens, "ignore_eos": True, "temperature": 0},
    )
    loop = asyncio.get_running_loop()
    pinned = asyncio.ensure_future(
        pinned_streams.generate(pinned_request, loop.time(), 600, loop.time)
    )
    try:
        deadline = time.monotonic() + 30
        while kv_sample(client, worker_id(a))[1] == 0:  # until A holds the pinned sequence
            if time.monotonic() > deadline:
                raise TimeoutError("the pinned generation did not start on replica A")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # a few router polls
        before_a = kv_sample(client, worker_id(a))
        served_before = model_successes(a, MODEL), model_successes(b, MODEL)
        load.address = router
        run = await closed_loop(load, args.concurrency)
        pinned_running = not pinned.done()
        served_after = model_successes(a, MODEL), model_successes(b, MODEL)
    finally:
        pinned.cancel()
        await asyncio.gather(pinned, return_exceptions=True)
        await pinned_streams.close()
        assert mesh.router is not None
        mesh.router.stop()
        mesh.router = None
    # A cancelled generation frees its KV at the worker's next step.
    deadline = time.monotonic() + 30
    while kv_sample(client, worker_id(a))[1] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    return {
        "policy": policy,
        "replica_a_before": dict(zip(("depth", "kv_used", "kv_total"), before_a, strict=True)),
        "pinned_still_running_at_end": pinned_running,
        # every request of the phase, warm-up or not, by the replica that served it
        "served_by_a": served_after[0] - served_before[0],
        "served_by_b": served_after[1] - served_before[1],
        "requests": run["requests"],
        "errors": run["errors"],
        "seconds": run["seconds"],
        "throughput_rps": run["throughput_rps"],
        "ttft_ms": run["ttft_ms"],
        "e2e_ms": run["e2e_ms"],
        "cdf": run["cdf"],
    }


async def run_phases(mesh: LocalMesh, a: str, b: str, args: argparse.Namespace) -> list[dict]:
    sizes = prompt_source.lengths(args.prompt_words, 0, 16)
    load = LLMLoad(
        "",
        MODEL,
        prompt_source.synthetic(sizes, seed=1),
        args.max_tokens,
        sampling={"temperature": 0, "ignore_eos": True},
        duration=args.seconds,
        warmup=0.0,
        timeout=120.0,
        max_requests=args.max_requests,
    )
    return [await phase(mesh, p, a, b, args, load) for p in ("p2c_depth", "p2c")]


def summarize(runs: list[dict], kv_tokens: int) -> dict:
    by = {r["policy"]: r for r in runs}
    plain, aware = by["p2c_depth"]["ttft_ms"], by["p2c"]["ttft_ms"]
    ratio = round(aware["p99"] / plain["p99"], 4) if plain["p99"] else None
    return {
        "kv_tokens_per_replica": kv_tokens,
        "served_by_full_replica_plain_p2c": by["p2c_depth"]["served_by_a"],
        "served_by_full_replica_kv_p2c": by["p2c"]["served_by_a"],
        "ttft_p99_ms_plain_p2c": plain["p99"],
        "ttft_p99_ms_kv_p2c": aware["p99"],
        "ttft_p50_ms_plain_p2c": plain["p50"],
        "ttft_p50_ms_kv_p2c": aware["p50"],
        "kv_over_plain_p99": ratio,
        "target_at_most_half_met": ratio is not None and ratio <= 0.5,
    }


def main() -> None:
    args = _parse_args()
    runs, wall = _measure(args)
    summary = summarize(runs, args.kv_tokens)
    result = {
        "benchmark": "kv_balance",
        "machine": {**machine(), "note": "shared machine, other jobs running: noisy"},
        "setup": _setup(args, wall),
        "runs": runs,
        "summary": summary,
    }
    path = write_result("kv_balance", result)
    print(f"wrote {path}")
    _print_reading(runs, summary)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0, help="measured, per policy")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-tokens", type=int, default=1024, help="KV budget per replica")
    parser.add_argument("--pinned-tokens", type=int, default=1000, help="A's long generation")
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8, help="of each short request")
    parser.add_argument("--max-requests", type=int, default=400, help="per policy")
    return parser.parse_args()


def _measure(args: argparse.Namespace) -> tuple[list[dict], float]:
    """Two replicas with a small KV budget, both policies' phases; and the phases' seconds."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = small_kv_repository(tmp / "repo", args.kv_tokens)
        logs = tmp / "logs"
        logs.mkdir()
        mesh = LocalMesh(logs, worker_args=WORKER_ARGS)
        mesh.start_redis()
        try:
            a, b = mesh.add_worker(repo), mesh.add_worker(repo)
            mesh.wait_registered(2)
            started = time.monotonic()
            runs = asyncio.run(run_phases(mesh, a, b, args))
            wall = round(time.monotonic() - started, 1)
        finally:
            mesh.stop(kill=True)
    return runs, wall


def _setup(args: argparse.Namespace, wall: float) -> dict:
    return {
        "replicas": 2,
        "kv_tokens_per_replica": args.kv_tokens,
        "pinned_on_a": {"max_tokens": args.pinned_tokens, "started": "directly on A"},
        "load": {
            "shape": "closed loop through the router",
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "max_requests": args.max_requests,
            "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens,
        },
        "wall_seconds": wall,
    }


def _print_reading(runs: list[dict], summary: dict) -> None:
    """Each policy's run, then the p99 ratio against the target and the p50s, from the
    figures."""
    for r in runs:
        t = r["ttft_ms"]
        print(
            f"{r['policy']:>9}: {r['requests']} requests measured, errors "
            f"{r['errors'] or 'none'}, {r['throughput_rps']} req/s, "
            f"TTFT p50 {t['p50']} ms, p99 {t['p99']} ms; served by "
            f"the full replica A: {r['served_by_a']}, by B: {r['served_by_b']}; A's pinned "
            f"generation {'still ran' if r['pinned_still_running_at_end'] else 'had ended'} "
            "when the load ended"
        )
    ratio = summary["kv_over_plain_p99"]
    if ratio is None:
        print("plain p2c measured no TTFT p99: no ratio")
    else:
        verdict = "meets" if summary["target_at_most_half_met"] else "misses"
        print(
            f"TTFT p99 under KV-aware p2c is {ratio:.3f}x plain p2c's "
            f"({summary['ttft_p99_ms_kv_p2c']} vs {summary['ttft_p99_ms_plain_p2c']} ms): "
            f"{verdict} the target of at most 0.5x"
        )
    p50_plain, p50_kv = summary["ttft_p50_ms_plain_p2c"], summary["ttft_p50_ms_kv_p2c"]
    if p50_plain and p50_kv:
        word = "higher" if p50_kv > p50_plain else "lower"
        parked = summary["served_by_full_replica_plain_p2c"]
        why = (
            f": plain p2c parked {parked} requests (and their callers) on A, so fewer shared B"
            if word == "higher" and parked > summary["served_by_full_replica_kv_p2c"]
            else ""
        )
        print(
            f"TTFT p50 is {word} under KV-aware p2c ({p50_kv} vs {p50_plain} ms, "
            f"{p50_kv / p50_plain:.2f}x){why}"
        )


# ---- benchmarks/README.md: this benchmark's section (python -m benchmarks.summary) ----


def section(r: dict) -> str:
    s, load = r["summary"], r["setup"]["load"]
    rows = [
        [
            x["policy"],
            x["requests"],
            x["throughput_rps"],
            x["ttft_ms"]["p50"],
            x["ttft_ms"]["p99"],
            x["served_by_a"],
            x["served_by_b"],
        ]
        for x in r["runs"]
    ]
    ratio = s["kv_over_plain_p99"]
    verdict = "meets" if s["target_at_most_half_met"] else "misses"
    return "\n\n".join(
        [
            "## KV-aware balancing: one replica's KV cache nearly full",
            f"`python -m benchmarks.kv_balance` — 2 SmolLM2 replicas with "
            f"{s['kv_tokens_per_replica']} KV tokens each; a long generation pinned on A; "
            f"a closed loop of {load['concurrency']} callers through the router, "
            f"{load['seconds']} s per policy, {load['max_tokens']} tokens per request "
            "(on A/on B: requests each replica served). "
            f"Machine: {r['machine'].get('note', 'not noted')}.",
            table(
                ["policy", "requests", "req/s", "TTFT p50 ms", "TTFT p99 ms", "on A", "on B"],
                rows,
            ),
            f"TTFT p99 under KV-aware p2c is {ratio}x plain p2c's: it {verdict} the target "
            "of at most 0.5x."
            if ratio is not None
            else "No TTFT p99 under plain p2c: no ratio.",
            f"TTFT p50: {s['ttft_p50_ms_kv_p2c']} ms under KV-aware p2c, "
            f"{s['ttft_p50_ms_plain_p2c']} ms under plain p2c "
            f"({round(s['ttft_p50_ms_kv_p2c'] / s['ttft_p50_ms_plain_p2c'], 2)}x).",
        ]
    )


if __name__ == "__main__":
    main()
