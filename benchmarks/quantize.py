"""Quantization on the real models, and dynamic batching of text through the worker.

    python -m benchmarks.quantize [--seconds 5] [--quick]

(a) MiniLM int8 (dynamic, per-channel) vs fp32: onnxruntime CPU latency at batch 1 and 16
    (16-token sentences, measured in alternation), with the gate's cosine.
(b) SmolLM2 recipes vs fp32: accuracy (top-1 agreement, KL, greedy match), the gate's
    verdict, decode-step and prefill latency for the accepted ones.
(c) MiniLM int8 served from TEXT by the worker, closed loop at concurrency 32: dynamic
    batching on vs off.
Builds what it needs in build/quantize (reused between runs). Writes
benchmarks/results/quantize.json.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, figure, machine, parse, standalone_worker, write_result
from common.bytes_codec import serialize_bytes
from loadtest.calls import closed_loop
from protos import grpc_service_pb2 as pb
from quantize import pipeline

CACHE = ROOT / "build" / "quantize"
REPORTS = CACHE / "reports"
SMOLLM2_RECIPES = ("decoder-int8-weight-only", "decoder-int4-weight-only", "decoder-int8-dynamic")
TEXT_PARAMS = (
    'parameters { key: "meshserve.tokenizer" value { string_value: "tokenizer.json" } }\n'
    'parameters { key: "meshserve.text_task" value { string_value: "embed" } }\n'
)
BATCHING = {
    "batching": "max_batch_size: 32\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n",
    "no_batching": "max_batch_size: 32\n",
}
SENTENCE = b"A man is eating a piece of bread while riding a horse."


def gated(model: str, recipe: str) -> dict:
    pipeline.quantize_model(model, recipe, CACHE)
    verdict = pipeline.evaluate_model(model, recipe, CACHE, REPORTS)
    print(f"{model}/{recipe}: {'accepted' if verdict.accepted else 'REFUSED'} {verdict.metrics}")
    return verdict.report


def batching_gain(seconds: float) -> dict:
    artifact = pipeline.Artifact(CACHE / "minilm" / "encoder-int8-dynamic")
    request = pb.ModelInferRequest()
    request.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(serialize_bytes(np.array([SENTENCE], dtype=object)))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        for name, config in BATCHING.items():
            (repo / name / "1").mkdir(parents=True)
            shutil.copy(artifact.model, repo / name / "1" / "model.onnx")
            shutil.copy(artifact.tokenizer, repo / name / "tokenizer.json")
            (repo / name / "config.pbtxt").write_text(config + TEXT_PARAMS)
        with standalone_worker(repo, Path(tmp), "--providers", "cpu") as address:
            for name in BATCHING:
                request.model_name = name
                results[name] = asyncio.run(closed_loop(address, request, 32, seconds))
                print(name, results[name])
    results["gain"] = round(
        results["batching"]["throughput_rps"] / results["no_batching"]["throughput_rps"], 2
    )
    return results


def speedups(report: dict) -> dict:
    out = {}
    for batch, per_file in report["latency_ms"].items():
        fp32, quantized = per_file.values()
        if isinstance(fp32, dict):
            out[batch] = {k: round(fp32[k] / quantized[k], 2) for k in fp32}
        else:
            out[batch] = round(fp32 / quantized, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parse(parser, seconds=1.0)  # and MiniLM only
    minilm = gated("minilm", "encoder-int8-dynamic")
    smollm2 = {} if args.quick else {r: gated("smollm2", r) for r in SMOLLM2_RECIPES}
    batching = batching_gain(args.seconds)
    payload = {
        "benchmark": "quantize",
        "machine": machine(),
        "minilm_int8": {
            "metrics": minilm["metrics"],
            "latency_ms": minilm["latency_ms"],
            "speedup": speedups(minilm),
            "size_ratio": minilm["size_ratio"],
        },
        "smollm2": {
            r: {
                "verdict": rep["verdict"],
                "failures": rep["failures"],
                "metrics": rep["metrics"],
                "latency_ms": rep["latency_ms"],
                "speedup": speedups(rep) if rep["latency_ms"] else {},
                "size_ratio": rep["size_ratio"],
            }
            for r, rep in smollm2.items()
        },
        "batching": {"seconds_per_point": args.seconds, "concurrency": 32, **batching},
    }
    path = write_result("quantize", payload, TITLE, rows(payload), args.quick)
    print(f"wrote {path}")


TITLE = "Quantization (real MiniLM and SmolLM2) and text batching"


def rows(r: dict) -> list[list]:
    """Headline rows: MiniLM int8's speedup and cosine, each SmolLM2 recipe's gate verdict
    and decode-step speedup, the batching gain."""
    m = r["minilm_int8"]
    out = [figure(f"MiniLM int8 / fp32 speedup at {b}", v, "x") for b, v in m["speedup"].items()]
    out.append(figure("MiniLM int8 mean cosine to fp32", m["metrics"]["mean_cosine"]))
    for recipe, d in r["smollm2"].items():
        step = d["speedup"].get("batch_1", {}).get("decode_step_ms")
        value = f"{d['verdict']}" + (f", decode step {step}x fp32" if step else "")
        out.append(figure(f"SmolLM2 {recipe}: the gate's verdict", value))
    out.append(
        figure("MiniLM int8 from TEXT: batching / none req/s at c=32", r["batching"]["gain"], "x")
    )
    return out


if __name__ == "__main__":
    main()
