"""llama.cpp in-process, for benchmarks/llm.py: runs under build/llamacpp-venv's Python
(stdlib + llama_cpp only), reads a job as JSON on stdin, prints one JSON object.

Job: {"model": gguf, "n_threads": 2, "n_ctx": 4096, "max_tokens": {"decode": 128, ...},
      "runs": {"decode": [prompt, ...], "prefill_500": [...], ...}, "logit_bias": {id: bias}}
Each run streams one completion at temperature 0 after clearing the KV cache (so no run
reuses another's prefix) and reports its text and when each piece arrived; the caller
counts the tokens. Also: RSS after loading and at the end (VmRSS, VmHWM), and llama.cpp's
own perf counters for the last run.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path


def rss_mb() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def perf(llm) -> dict:  # type: ignore[no-untyped-def]
    try:
        import llama_cpp

        data = llama_cpp.llama_perf_context(llm._ctx.ctx)
        return {
            "prompt_eval_ms": data.t_p_eval_ms,
            "prompt_tokens": data.n_p_eval,
            "eval_ms": data.t_eval_ms,
            "eval_tokens": data.n_eval,
        }
    except Exception as e:  # the binding's layout differs between versions
        return {"unavailable": f"{type(e).__name__}: {e}"}


def one(llm, prompt: str, max_tokens: int, logit_bias: dict) -> dict:  # type: ignore[no-untyped-def]
    llm.reset()
    with contextlib.suppress(Exception):  # drop the KV cache too, not just the token count
        llm._ctx.kv_cache_clear()
    start = time.perf_counter()
    first = last = None
    text = []
    stream = llm.create_completion(
        prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        logit_bias=logit_bias or None,
    )
    for chunk in stream:
        piece = chunk["choices"][0]["text"]
        now = time.perf_counter() - start
        if piece:
            first = now if first is None else first
            last = now
            text.append(piece)
    return {"text": "".join(text), "first_s": first, "last_s": last, "perf": perf(llm)}


def main() -> None:
    job = json.load(sys.stdin)
    from llama_cpp import Llama, __version__

    t0 = time.perf_counter()
    llm = Llama(
        model_path=job["model"],
        n_threads=job["n_threads"],
        n_threads_batch=job["n_threads"],
        n_ctx=job["n_ctx"],
        verbose=False,
    )
    out = {
        "llama_cpp_python": __version__,
        "load_s": round(time.perf_counter() - t0, 2),
        "rss_after_load_mb": rss_mb(),
        "runs": {},
    }
    bias = {int(k): float(v) for k, v in job.get("logit_bias", {}).items()}
    for name, prompts in job["runs"].items():
        out["runs"][name] = [one(llm, p, job["max_tokens"][name], bias) for p in prompts]
    out["rss_end_mb"] = rss_mb()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
