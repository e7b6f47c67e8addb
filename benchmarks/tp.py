"""Tensor parallelism on this machine: TP1 vs TP2/TP3, split into compute and communication.

    python -m benchmarks.tp [--repeat 20] [--skip-decoder]

Real MiniLM (all 6 layers) at batch 1 and 8 (32 tokens), and real SmolLM2 (all 30 layers;
TP 1 and 3: 9 heads / 3 KV heads) greedily generating 8 tokens at batch 1 and 8 from a
16-token prompt. Each point starts a fresh gloo group (worker/tp_local.py), warms up, then
times `--repeat` forwards on rank 0: total, onnxruntime compute (the segments), and
communication (the collectives, including waiting for the slowest rank). TP1 runs twice:
one process with every core (what a single-process worker does) and one process with one
thread (the compute that TP divides). Writes benchmarks/results/tp.json; the reading it
prints (and benchmarks/README.md) is computed from the numbers by benchmarks/readings.py.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import readings
from benchmarks.common import ROOT, machine, write_result
from quantize import shard, weights
from worker.tp_local import run_group

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
    args = parser.parse_args()
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
        ensure_shards("smollm2", smol, DECODER_TPS)
        dec_feeds = {
            b: {"input_ids": rng.integers(100, 40000, (b, 16)).astype(np.int64)} for b in BATCHES
        }
        payload["smollm2"] = sweep(
            "smollm2", dec_feeds, DECODER_TPS, max(3, args.repeat // 4), "--new-tokens", "8"
        )
        payload["smollm2"]["new_tokens"] = 8
        payload["smollm2"]["config_layers"] = smol.model.config.layers  # type: ignore[union-attr]
    payload["reading"] = readings.tp_reading(payload)
    print(payload["reading"])
    print(write_result("tp", payload))


if __name__ == "__main__":
    main()
