"""The step graph's shape, measured: SmolLM2 int8 weight-only, one stream, the graph alone.

Variants, each timed in the same run, rounds interleaved:
  before     a step graph built before q/k/v and gate/up were fused (--before PATH), logits
             copied out of onnxruntime and argmax'd in numpy
  fused      packed q/k/v + fused gate/up, float32 KV cache, logits + numpy argmax
  fused-top  the same graph, the graph's own top-k read instead of the logits (run_top)
  fp16-kv    fused, the KV cache in float16 (llama.cpp's default), top-k

Per variant: decode tokens/s (one stream, 128 greedy steps after a 25-token prompt) and the
time to first token of that prompt (prefill run + first choice), medians of --rounds rounds.

    python -m benchmarks.llm_graph [--before PATH] [--rounds 3] [--threads 2]
writes benchmarks/results/llm_graph.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from quantize import checkpoint, llm_graph, recipes, weights
from worker.llm.cache import KVCache, page_aligned
from worker.llm.model import StepModel
from worker.runtime import CPU, RuntimeOptions

RESULTS = Path(__file__).resolve().parent / "results" / "llm_graph.json"
PROMPT, STEPS = 25, 128


def build(folder: Path, kv_dtype: str) -> Path:
    """SmolLM2's fused step graph with the KV cache in kv_dtype, int8 weight-only."""
    fp32 = llm_graph.save(
        llm_graph.build(checkpoint.load_gguf(weights.smollm2_gguf()).model(), kv_dtype=kv_dtype),
        folder / f"fp32-{kv_dtype}.onnx",
    )
    out = folder / f"int8-{kv_dtype}.onnx"
    apply = recipes.RECIPES["decoder-int8-weight-only"].apply
    assert apply is not None
    apply(fp32, out)
    fp32.unlink()
    return out


def one_round(model: StepModel, top: bool) -> tuple[float, float]:
    """(decode tokens/s, TTFT seconds) of one greedy stream."""
    f = model.facts
    cache = KVCache(f.cache_shape(1, page_aligned(512, f.kv_heads * f.head_dim, itemsize=4)), 512)
    try:
        step: Callable[[np.ndarray, int], int]
        if top:

            def step(ids: np.ndarray, n: int) -> int:
                return int(model.run_top(cache, ids, np.array([n]), 0, 1)[1][0, 0])
        else:

            def step(ids: np.ndarray, n: int) -> int:
                return int(model.run(cache, ids, np.array([n]), 0, 1)[0].argmax())

        prompt = np.arange(1000, 1000 + PROMPT, dtype=np.int64)[None]
        t0 = time.perf_counter()
        token = step(prompt, PROMPT)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(STEPS):
            token = step(np.array([[token]], np.int64), PROMPT + 1 + i)
        return STEPS / (time.perf_counter() - t0), ttft
    finally:
        cache.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llm_graph")
    parser.add_argument("--before", type=Path, help="an unfused step graph (int8) to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    options = RuntimeOptions(intra_op_threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {"fused": build(Path(tmp), "float32"), "fp16-kv": build(Path(tmp), "float16")}
        models = {k: StepModel.load(p, options, [CPU]) for k, p in graphs.items()}
        if args.before is not None:
            models["before"] = StepModel.load(args.before, options, [CPU])
        variants = {"fused": ("fused", False), "fused-top": ("fused", True)}
        variants["fp16-kv"] = ("fp16-kv", True)
        if "before" in models:
            variants["before"] = ("before", False)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for model, top in variants.values():  # warm-up
            one_round(models[model], top)
        for _ in range(args.rounds):
            for name, (model, top) in variants.items():
                runs[name].append(one_round(models[model], top))
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads "
        "(a 2-core VM shared with other agents' builds and tests)",
        "rounds": args.rounds,
        "prompt_tokens": PROMPT,
        "decode_steps": STEPS,
        "variants": {
            name: {
                "decode_tok_s": round(statistics.median(r[0] for r in rs), 1),
                "ttft_ms": round(1000 * statistics.median(r[1] for r in rs), 1),
                "rounds": [[round(a, 1), round(1000 * b, 1)] for a, b in rs],
            }
            for name, rs in runs.items()
        },
    }
    base = result["variants"].get("before") or result["variants"]["fused"]  # type: ignore[attr-defined]
    for v in result["variants"].values():  # type: ignore[attr-defined]
        v["decode_vs_base"] = round(v["decode_tok_s"] / base["decode_tok_s"], 3)
    result["fastest_decode"] = max(
        result["variants"].items(),  # type: ignore[attr-defined]
        key=lambda kv: kv[1]["decode_tok_s"],
    )[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
