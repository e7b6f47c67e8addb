"""The measurements behind benchmarks/llm.py, one function per system: llama.cpp in its own
process, and each server (llama-cpp-python's, a meshserve worker) driven by loadtest's LLM
mode (loadtest/llm: its OpenAI SSE wire or ModelStreamInfer), every stream timed and counted
the same way: TTFT = the first non-empty piece; a request's ITL = (last piece - first) /
(its tokens - 1); tokens counted by re-tokenizing the prompt and the returned text with
SmolLM2's tokenizer (count_tokens="tokenizer"), never taken from a server's usage. The
summary sentences are llm_summary.py's."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from benchmarks.common import RssSampler, free_port, http_server, rss_tree_mb
from loadtest.llm import prompts as prompt_source
from loadtest.llm.prompts import Prompt
from loadtest.llm.runner import LLMLoad, closed_loop
from loadtest.llm.stats import LLMRecorder
from loadtest.llm.stream import Outcome

TIMEOUT_S = 300.0  # one request's deadline


@dataclass
class Context:
    args: argparse.Namespace
    gguf: Path
    tokenizer: Tokenizer
    eos_ids: list[int]
    eos_token: str
    bos_token: str | None
    made: int = 0  # prompt sets cut so far: each its own seed, so windows differ

    @classmethod
    def create(cls, args: argparse.Namespace, cache: Path) -> Context:
        from quantize.weights import smollm2_gguf

        gguf = smollm2_gguf()
        tokenizer = smollm2_tokenizer(gguf, cache / "smollm2-tokenizer" / "tokenizer.json")
        ids = {t: tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
        ends = {t: i for t, i in ids.items() if i is not None}
        bos = "<|im_start|>" if tokenizer.token_to_id("<|im_start|>") is not None else None
        return cls(args, gguf, tokenizer, list(ends.values()), next(iter(ends)), bos)

    @property
    def ignore_eos(self) -> bool:
        return bool(self.args.ignore_eos)

    def prompts(self, sizes: list[int]) -> list[Prompt]:
        """Prompts of these SmolLM2-token lengths: windows of Python's language reference at
        random offsets (loadtest/llm/prompts.py), a fresh seed each call."""
        self.made += 1
        return prompt_source.synthetic(sizes, self.tokenizer, seed=self.made)

    def single_plan(self) -> dict[str, tuple[list[Prompt], int]]:
        """name -> (prompts, max_tokens): decode on a short prompt, prefill on long ones."""
        r = self.args.repeats
        return {
            "decode": (self.prompts([32] * r), self.args.decode_tokens),
            "prefill_500": (self.prompts([500] * r), 2),
            "prefill_1500": (self.prompts([1500] * r), 2),
        }


def smollm2_tokenizer(gguf: Path, cached: Path) -> Tokenizer:
    """SmolLM2's tokenizer rebuilt from the GGUF (quantize/weights.py), cached as JSON:
    gguf.GGUFReader takes ~30 s to parse the vocabulary here."""
    if cached.exists():
        return Tokenizer.from_file(str(cached))
    from gguf import GGUFReader

    from quantize.weights import gguf_tokenizer

    tokenizer = gguf_tokenizer(GGUFReader(str(gguf)))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(cached))
    return tokenizer


def single_run(row: dict) -> dict:
    """One stream alone, from its loadtest row: decode tokens/s after the first token (1 /
    its ITL), prompt tokens/s (prompt tokens / TTFT, which holds one decode step and the
    transport)."""
    ttft, itl, prompt = row.get("ttft_ms"), row.get("itl_ms"), row.get("prompt_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": row.get("completion_tokens", 0),
        "ttft_ms": round(ttft, 1) if ttft is not None else None,
        "itl_ms": round(itl, 2) if itl else None,
        "decode_tokens_per_s": round(1000 / itl, 1) if itl else None,
        "prompt_tokens_per_s": round(prompt * 1000 / ttft, 1) if ttft and prompt else None,
        "error": row.get("error"),
    }


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(float(np.median(values)), 1) if values else None


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def _single_summary(runs: dict[str, list[dict]]) -> dict:
    return {
        "decode_tokens_per_s": median_of(runs["decode"], "decode_tokens_per_s"),
        "itl_ms": median_of(runs["decode"], "itl_ms"),
        "prompt_tokens_per_s_500": median_of(runs["prefill_500"], "prompt_tokens_per_s"),
        "prompt_tokens_per_s_1500": median_of(runs["prefill_1500"], "prompt_tokens_per_s"),
        "ttft_ms_1500": median_of(runs["prefill_1500"], "ttft_ms"),
    }


# ---- llama.cpp in-process ------------------------------------------------------------------


def omp_env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return env if policy == "default" else {**env, "OMP_WAIT_POLICY": policy}


def llamacpp_inprocess(ctx: Context, omp: str | None = None, short: bool = False) -> dict:
    """short: one decode of 32 tokens and one 500-token prefill (for a slow configuration)."""
    python = ctx.args.llamacpp_venv / "bin" / "python"
    if not python.exists():
        return {"skipped": f"{python} not found: `make llamacpp-venv` builds it"}
    omp = omp or ctx.args.omp_wait_policy
    plan = ctx.single_plan()
    if short:
        plan = {
            "decode": (ctx.prompts([32]), 32),
            "prefill_500": (ctx.prompts([500]), 2),
            "prefill_1500": ([], 2),
        }
    job = {
        "model": str(ctx.gguf),
        "n_threads": ctx.args.threads,
        "n_ctx": 4096,
        "max_tokens": {k: v[1] for k, v in plan.items()},
        "runs": {k: [p.text for p in v[0]] for k, v in plan.items()},
        "logit_bias": {str(i): -100.0 for i in ctx.eos_ids} if ctx.ignore_eos else {},
    }
    script = Path(__file__).with_name("llm_inprocess.py")
    done = subprocess.run(
        [str(python), str(script)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=900,
        env=omp_env(omp),
    )
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    raw = json.loads(done.stdout)
    runs: dict[str, list[dict]] = {}
    for name, outs in raw["runs"].items():
        prompts = plan[name][0]
        runs[name] = [_inprocess_run(ctx, p, o) for p, o in zip(prompts, outs, strict=True)]
    return {
        "how": "llama_cpp.Llama in its own process, n_threads=n_threads_batch="
        f"{ctx.args.threads}, n_ctx 4096, KV cache cleared before each run, "
        f"OMP_WAIT_POLICY {omp}",
        "llama_cpp_python": raw["llama_cpp_python"],
        "load_s": raw["load_s"],
        "rss_mb": {"after_load": raw["rss_after_load_mb"], "end": raw["rss_end_mb"]},
        "single": _single_summary(runs),
        "runs": runs,
        "llama_perf_last_run": next(
            (r[-1]["perf"] for r in reversed(raw["runs"].values()) if r), {}
        ),
    }


def _inprocess_run(ctx: Context, prompt: Prompt, out: dict) -> dict:
    """llama.cpp's first and last piece, timed in its process, counted as a served stream
    is: its text and prompt re-tokenized (loadtest/llm/stats.py, count="tokenizer")."""
    recorder = LLMRecorder(ctx.tokenizer, count="tokenizer")
    pieces = [out["first_s"], out["last_s"]] if out["first_s"] is not None else []
    recorder.add(Outcome(0.0, out["last_s"] or 0.0, pieces, text=out["text"]), prompt.text)
    return single_run(recorder.summary()["per_request"][0])


# ---- servers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A server as loadtest's LLM mode reaches it: its wire, model name and sampling keys."""

    address: str
    api: str  # "triton" (ModelStreamInfer) or "openai" (/v1/completions, SSE)
    model: str
    sampling: dict

    def load(self, ctx: Context, prompts: list[Prompt], max_tokens: int, **kw: Any) -> LLMLoad:
        """Every token counted by re-tokenizing with SmolLM2's tokenizer, as in-process."""
        return LLMLoad(
            self.address,
            self.model,
            prompts,
            max_tokens,
            sampling=self.sampling,
            api=self.api,
            tokenizer=ctx.tokenizer,
            count_tokens="tokenizer",
            timeout=TIMEOUT_S,
            **kw,
        )


async def serve_and_measure(ctx: Context, target: Target, pid: int | None, label: str) -> dict:
    start_rss = rss_tree_mb(pid) if pid else None
    with RssSampler(pid) as rss:
        await closed_loop(target.load(ctx, ctx.prompts([16]), 4, max_requests=1), 1)  # warm-up
        runs = {}
        for name, (prompts, n) in ctx.single_plan().items():
            load = target.load(ctx, prompts, n, max_requests=len(prompts), duration=3600)
            runs[name] = [single_run(r) for r in (await closed_loop(load, 1))["per_request"]]
        levels = []
        for c in ctx.args.concurrency:
            point = await concurrency_level(ctx, target, c)
            print(label, f"c={c}", {k: point[k] for k in ("output_tokens_per_s", "ttft_p50_ms")})
            levels.append(point)
    return {
        "single": _single_summary(runs),
        "runs": runs,
        "concurrency": levels,
        "rss_mb": {"before_load_test": start_rss, **rss.report()},
    }


async def concurrency_level(ctx: Context, target: Target, streams: int) -> dict:
    """`streams` closed-loop callers over prompts of --lengths in turn, --requests-per-stream
    each, starting none after --level-deadline-s: aggregate output tokens/s = all completion
    tokens / the span; TTFT and each request's own ITL at p50 / p99."""
    lengths, per = ctx.args.lengths, ctx.args.requests_per_stream
    sizes = [lengths[(i + j) % len(lengths)] for j in range(per) for i in range(streams)]
    load = target.load(
        ctx,
        ctx.prompts(sizes),
        ctx.args.max_tokens,
        max_requests=len(sizes),
        duration=ctx.args.level_deadline_s,
    )
    point = await closed_loop(load, streams)
    rows = [r for r in point["per_request"] if r["error"] is None]
    ttft = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
    itl = [r["itl_ms"] for r in rows if r["itl_ms"] is not None]
    errors = sum(point["errors"].values())
    return {
        "streams": streams,
        "requests": point["requests"] + errors,
        "errors": errors,
        "first_error": next(iter(point["errors"]), None),
        "wall_s": round(point["seconds"], 2),
        "prompt_tokens": [r["prompt_tokens"] for r in rows],
        "completion_tokens": point["output_tokens"],
        "output_tokens_per_s": round(point["output_tokens_per_s"], 1),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "itl_p50_ms": _pct(itl, 50),
        "itl_p99_ms": _pct(itl, 99),
        "token_source": point["token_source"],
    }


@contextlib.asynccontextmanager
async def llamacpp_server_process(ctx: Context, logs: Path) -> AsyncIterator[tuple[int, int]]:
    python = ctx.args.llamacpp_venv / "bin" / "python"
    port = free_port()
    threads = str(ctx.args.threads)
    args = [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(ctx.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        "--n_ctx",
        "4096",
        # by default a new request interrupts the one streaming: queue them instead
        "--interrupt_requests",
        "False",
    ]
    env = omp_env(ctx.args.omp_wait_policy)
    async with http_server(args, logs / "llamacpp-server.log", port, "/v1/models", 120, env) as pid:
        yield port, pid


async def llamacpp_server(ctx: Context, logs: Path) -> dict:
    if not (ctx.args.llamacpp_venv / "bin" / "python").exists():
        return {"skipped": f"{ctx.args.llamacpp_venv} not found"}
    bias = {str(i): -100 for i in ctx.eos_ids} if ctx.ignore_eos else {}
    async with llamacpp_server_process(ctx, logs) as (port, pid):
        sampling = {"temperature": 0, **({"logit_bias": bias} if bias else {})}
        target = Target(f"http://127.0.0.1:{port}", "openai", "smollm2", sampling)
        out = await serve_and_measure(ctx, target, pid, "llama.cpp server")
    return {
        "how": "python -m llama_cpp.server (llama-cpp-python[server]==0.3.36), 127.0.0.1, "
        f"n_threads=n_threads_batch={ctx.args.threads}, n_ctx 4096, OMP_WAIT_POLICY "
        f"{ctx.args.omp_wait_policy}, interrupt_requests False (queue, do not cut "
        "the running stream); streamed "
        "/v1/completions over HTTP/1.1 (server-sent events)",
        **out,
    }


async def meshserve(ctx: Context, address: str, pid: int | None) -> dict:
    sampling = {"temperature": 0, **({"ignore_eos": True} if ctx.ignore_eos else {})}
    out = await serve_and_measure(
        ctx, Target(address, "triton", ctx.args.model, sampling), pid, "meshserve"
    )
    return {
        "how": f"meshserve worker at {address}, model {ctx.args.model!r}: gRPC "
        "ModelStreamInfer, Triton vLLM-backend tensors (text_input, stream, "
        "sampling_parameters, exclude_input_in_output -> text_output)",
        **out,
    }
