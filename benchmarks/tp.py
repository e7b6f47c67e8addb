"""Tensor parallelism on this machine: TP1 vs TP2/TP3, split into compute and communication.

    python -m benchmarks.tp [--repeat 20] [--skip-decoder] [--quick]

Real MiniLM (all 6 layers) at batch 1 and 8 (32 tokens), and real SmolLM2 (all 30 layers;
TP 1 and 3: 9 heads / 3 KV heads) served by the LLM engine over a group
(worker/tp/llm_step.py): 1 and 8 concurrent greedy requests of 32 new tokens. Each point starts
a fresh gloo group (worker/tp/local.py). MiniLM: warm up, then time `--repeat` forwards on
rank 0: total, onnxruntime compute (the segments), and communication (the collectives,
including waiting for the slowest rank). SmolLM2: generated tokens per second over the
whole run (prefill included), with rank 0's compute and communication time. TP1 runs
twice: one process with every core (what a single-process worker does) and one process
with one thread (the compute that TP divides). Writes benchmarks/results/tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, figure, machine, parse, write_result
from quantize import llm, llm_shard, shard, weights
from worker.tp.local import run_group, run_llm_group

CACHE = ROOT / "build" / "bench-tp"
ENCODER_TPS = (1, 2, 3)
DECODER_TPS = (1, 3)
BATCHES = (1, 8)


def ensure_shards(name: str, loaded: weights.Loaded, tps: tuple[int, ...]) -> Path:
    for tp in tps:
        if not (CACHE / name / "1" / f"tp{tp}" / shard.MANIFEST).exists():
            print(f"sharding {name} for TP {tp} into {CACHE}", flush=True)
            shard.write_shards(loaded.model, name, CACHE / name, tp)
    return CACHE


def ensure_llm_shards(name: str, loaded: weights.Loaded, tps: tuple[int, ...]) -> Path:
    missing = [tp for tp in tps if not (CACHE / name / "1" / f"tp{tp}" / shard.MANIFEST).exists()]
    if missing:
        print(f"sharding {name}'s engine graph for TP {missing} into {CACHE}", flush=True)
        llm_shard.write_model(
            loaded.model,  # type: ignore[arg-type]
            loaded.tokenizer,
            name,
            CACHE,
            missing,
            llm.MAX_POSITIONS,
        )
    return CACHE


def rank_bytes(name: str, tp: int) -> list[int]:
    manifest = json.loads((CACHE / name / "1" / f"tp{tp}" / shard.MANIFEST).read_text())
    return [int(r["weight_bytes"]) for r in manifest["ranks"]]


def med_ms(values: np.ndarray) -> float:
    return round(float(np.median(values)) / 1e6, 3)


def point(
    name: str, tp: int, threads: int, feeds: dict, repeat: int, workdir: Path, *extra: str
) -> dict:
    out = run_group(
        CACHE,
        name,
        tp,
        feeds,
        workdir,
        "--intra-op-threads",
        str(threads),
        "--repeat",
        str(repeat),
        "--warmup",
        "3",
        *extra,
    )
    return {
        "tp": tp,
        "threads_per_rank": threads,
        "total_ms": med_ms(out["total_ns"]),
        "compute_ms": med_ms(out["compute_ns"]),
        "comm_ms": med_ms(out["comm_ns"]),
        "outputs": {k: v for k, v in out.items() if not k.endswith("_ns")},
    }


def sweep(name: str, feeds_for: dict, tps: tuple[int, ...], repeat: int, *extra: str) -> dict:
    cores = os.cpu_count() or 1
    results: dict[str, list] = {}
    errors: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch, feeds in feeds_for.items():
            rows = []
            configs = [(1, cores), *((tp, 1) for tp in tps)]
            base = None
            for tp, threads in configs:
                p = point(name, tp, threads, feeds, repeat, Path(tmp), *extra)
                outs = p.pop("outputs")
                key = "sentence_embedding" if "sentence_embedding" in outs else "logits_0"
                if base is None:
                    base = outs[key]
                else:
                    err = float(np.abs(outs[key] - base).max())
                    errors[f"b{batch}_tp{tp}"] = max(errors.get(f"b{batch}_tp{tp}", 0.0), err)
                print(name, f"batch {batch}", p, flush=True)
                rows.append(p)
            one_proc = rows[0]["total_ms"]
            for r in rows:
                r["vs_tp1_all_cores"] = round(r["total_ms"] / one_proc, 2)
            results[f"batch{batch}"] = rows
    return {
        "latency": results,
        "max_abs_diff_vs_tp1": errors,
        "weight_bytes_per_rank": {f"tp{tp}": rank_bytes(name, tp) for tp in tps},
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--skip-decoder", action="store_true")
    args = parse(parser, repeat=3, skip_decoder=True)
    rng = np.random.default_rng(0)
    payload: dict = {"machine": machine(), "backend": "gloo", "repeat": args.repeat}

    minilm = weights.load_minilm()
    ensure_shards("minilm", minilm, ENCODER_TPS)
    enc_feeds = {
        b: {
            "input_ids": rng.integers(1000, 20000, (b, 32)).astype(np.int64),
            "attention_mask": np.ones((b, 32), np.int64),
        }
        for b in BATCHES
    }
    payload["minilm"] = sweep("minilm", enc_feeds, ENCODER_TPS, args.repeat)
    if not args.skip_decoder:
        smol = weights.load_smollm2()
        ensure_llm_shards("smollm2", smol, DECODER_TPS)
        # its own key: the rows are tokens/s through the engine, not forward latencies
        payload["smollm2_engine"] = decoder_sweep("smollm2", DECODER_TPS)
    for row in rows(payload):
        print(*row)
    print(write_result("tp", payload, TITLE, rows(payload), args.quick))


DECODE_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Tensor parallelism splits a model",
    "Once upon a time",
    "The three primary colors are",
    "Explain what a KV cache is.",
    "import numpy as np",
]


def decoder_sweep(name: str, tps: tuple[int, ...]) -> dict:
    cores = os.cpu_count() or 1
    tokenizer = CACHE / name / "tokenizer.json"
    config = {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_tokens": 4096}
    results: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for streams in BATCHES:
            wave = [{"text": t, "max_tokens": DECODE_TOKENS} for t in PROMPTS[:streams]]
            rows = []
            for tp, threads in [(1, cores), *((tp, 1) for tp in tps)]:
                out = run_llm_group(
                    CACHE,
                    name,
                    tp,
                    [wave[:1], wave],  # the first wave warms up
                    tokenizer,
                    Path(tmp),
                    "--intra-op-threads",
                    str(threads),
                    engine_config=config,
                )
                tokens = sum(len(r["tokens"]) for r in out["results"][1])
                row = {
                    "tp": tp,
                    "threads_per_rank": threads,
                    "streams": streams,
                    "tokens_per_s": round(tokens / out["waves_seconds"][1], 1),
                    "compute_s": round(out["compute_ns"] / 1e9, 2),
                    "comm_s": round(out["comm_ns"] / 1e9, 2),
                    "errors": [r["error"] for r in out["results"][1] if r["error"]],
                }
                print(name, row, flush=True)
                rows.append(row)
            results[f"streams{streams}"] = rows
    return {
        "throughput": results,
        "new_tokens": DECODE_TOKENS,
        "weight_bytes_per_rank": {f"tp{tp}": rank_bytes(name, tp) for tp in tps},
    }


TITLE = "Tensor parallelism: TP1 vs TP2/TP3 on this CPU (gloo)"


def rows(r: dict) -> list[list]:
    """Headline rows: each TP N's latency against one process with every core, its weight
    bytes per rank against TP1's, and the engine's tokens/s at TP1 and TP3."""
    out = []
    for model in ("minilm", "smollm2"):
        if model not in r:
            continue
        for batch, points in r[model]["latency"].items():
            split = [p for p in points if p["tp"] > 1]
            figures = ", ".join(f"TP{p['tp']} {p['vs_tp1_all_cores']}x" for p in split)
            out.append(figure(f"{model} {batch}: latency / TP1 with every core", figures))
        mb = {k: max(v) / 1e6 for k, v in r[model]["weight_bytes_per_rank"].items()}
        ratios = ", ".join(f"{k.upper()} {v / mb['tp1']:.2f}x" for k, v in mb.items() if k != "tp1")
        out.append(figure(f"{model}: weight bytes per rank / TP1's", ratios))
    engine = r.get("smollm2_engine", {}).get("throughput", {})
    for streams, points in engine.items():
        figures = ", ".join(
            f"TP{p['tp']} ({p['threads_per_rank']} threads) {p['tokens_per_s']}" for p in points
        )
        out.append(figure(f"smollm2 engine, {streams}: tok/s", figures))
    return out


if __name__ == "__main__":
    main()
