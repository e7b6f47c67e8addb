"""benchmarks/llm.py's context (the GGUF, SmolLM2's tokenizer, the prompts) and its
in-process reference: llama.cpp (llama-cpp-python) in its own process, each stream timed and
counted as loadtest's LLM mode times a served one: TTFT = the first non-empty piece; a
request's ITL = (last piece - first) / (its tokens - 1); tokens counted by re-tokenizing the
prompt and the returned text with SmolLM2's tokenizer."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from loadtest.llm import prompts as prompt_source
from loadtest.llm.prompts import Prompt
from loadtest.llm.stats import LLMRecorder
from loadtest.llm.stream import Outcome

if TYPE_CHECKING:
    from benchmarks.llm_checkpoint import Prepared

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
    def create(
        cls, args: argparse.Namespace, cache: Path, checkpoint: Prepared | None = None
    ) -> Context:
        """SmolLM2's GGUF, or `checkpoint`'s (its tokenizer: the one its repository serves,
        SmolLM2's padded: benchmarks/llm_checkpoint.py)."""
        from quantize.weights import smollm2_gguf

        if checkpoint is None:
            gguf = smollm2_gguf()
            tokenizer = gguf_tokenizer(gguf, cache / "smollm2-tokenizer" / "tokenizer.json")
        else:
            gguf = checkpoint.gguf
            served = checkpoint.repository / checkpoint.model / "tokenizer.json"
            tokenizer = Tokenizer.from_file(str(served))
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


def gguf_tokenizer(gguf: Path, cached: Path) -> Tokenizer:
    """A GGUF's tokenizer rebuilt from its metadata (quantize/weights.py), cached as JSON:
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
