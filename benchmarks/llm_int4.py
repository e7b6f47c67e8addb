"""Why int4 was refused on SmolLM2 and what passes: the gate on each variant, sizes, and
decode-step latency of fp32, int8 and int4 measured in alternation.

    python -m benchmarks.llm_int4 [--skip-ablation]

Variants of the fp32 export (SmolLM2's Q4_1 GGUF, dequantized), each gated against it:
- `ort-symmetric` — the former recipe: onnxruntime's MatMulNBitsQuantizer, symmetric int4
  blocks of 32, accuracy_level 4, on the dequantized weights;
- `gguf-codes-rounded-zp` — the GGUF's own codes and scales, zero point rounded to an
  integer (quantize_matmuls(exact=False));
- `decoder-int4-weight-only` — the recipe now: the GGUF's codes, integer zero point plus a
  per-block residual (exact weights), accuracy_level 4;
- `gguf-exact-accuracy-level-1` — the same weights computed in float (accuracy_level 1).
Builds in build/quantize (reused). Writes benchmarks/results/llm_int4.json.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import onnx
from tokenizers import Tokenizer

from benchmarks.common import ROOT, machine, write_result
from benchmarks.readings import table
from quantize import evaluate, int4, pipeline, recipes

CACHE = ROOT / "build" / "quantize"
MODEL = "smollm2"
INT8, INT4 = "decoder-int8-weight-only", "decoder-int4-weight-only"


def _exact(accuracy_level: int, exact: bool) -> Callable[[Path, Path], None]:
    def apply(src: Path, dst: Path) -> None:
        model = onnx.load(str(src))
        int4.quantize_matmuls(model, accuracy_level=accuracy_level, exact=exact, otherwise="int4")
        onnx.save(model, str(dst))

    return apply


ABLATION = {
    "ort-symmetric": recipes._weight_only(4, 32),
    "gguf-codes-rounded-zp": _exact(4, exact=False),
    "gguf-exact-accuracy-level-1": _exact(1, exact=True),
}


def build(name: str, apply: Callable[[Path, Path], None], fp32: Path) -> Path:
    path = CACHE / MODEL / "experiments" / name / "model.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        apply(fp32, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-ablation", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    fp32 = pipeline.export_model(MODEL, CACHE)
    paths = {
        "fp32": fp32.model,
        INT8: pipeline.quantize_model(MODEL, INT8, CACHE).model,
        INT4: pipeline.quantize_model(MODEL, INT4, CACHE).model,
    }
    variants = {INT4: paths[INT4]}
    if not args.skip_ablation:
        variants |= {k: build(k, fn, fp32.model) for k, fn in ABLATION.items()}
    variants[INT8] = paths[INT8]
    tokenizer = Tokenizer.from_file(str(fp32.tokenizer))
    gate: dict[str, dict] = {}
    for name, path in variants.items():
        t0 = time.perf_counter()
        metrics = evaluate.evaluate_decoder(fp32.model, path, tokenizer, "CPUExecutionProvider")
        failures = [
            t.describe(metrics[t.metric])
            for t in recipes.DECODER_GATE
            if not t.passes(metrics[t.metric])
        ]
        gate[name] = {
            "metrics": {k: round(v, 4) for k, v in metrics.items()},
            "verdict": "refused" if failures else "accepted",
            "failures": failures,
            "bytes": path.stat().st_size,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(name, gate[name], flush=True)
    model = onnx.load(str(fp32.model))
    report = int4.quantize_matmuls(model, gguf_path=_gguf(), otherwise="int4")
    vocab = tokenizer.get_vocab_size()
    latency = {
        f"batch_{b}": evaluate.decoder_latency(paths, b, vocab, args.repeats) for b in (1, 16)
    }
    step = {b: {k: v["decode_step_ms"] for k, v in lat.items()} for b, lat in latency.items()}
    reading = [
        f"{name}: top-1 {g['metrics']['top1_agreement']}, KL {g['metrics']['kl_divergence']}, "
        f"greedy match {g['metrics']['greedy_match']} -> {g['verdict']}"
        for name, g in gate.items()
    ] + [
        f"{b}: decode step fp32 {s['fp32']} ms, int8 {s[INT8]} ms "
        f"({s['fp32'] / s[INT8]:.2f}x), int4 {s[INT4]} ms ({s['fp32'] / s[INT4]:.2f}x)"
        for b, s in step.items()
    ]
    path = write_result(
        "llm_int4",
        {
            "benchmark": "llm_int4",
            "machine": machine(),
            "note": "shared 2-core machine, other work running: latency is noisy",
            "gate": gate,
            "weights": {
                "codecs": report.counts(),
                "max_abs_error": report.max_abs_error,
                "matmul_bytes_fp32": sum(e.bytes_before for e in report.entries),
                "matmul_bytes_after": sum(e.bytes_after for e in report.entries),
            },
            "latency_ms": latency,
            "reading": reading,
        },
    )
    for line in reading:
        print(line)
    print(f"wrote {path}")


def _gguf() -> Path:
    from quantize.weights import smollm2_gguf

    return smollm2_gguf()


# ---- benchmarks/README.md: this benchmark's section (python -m benchmarks.summary) ----


def section(r: dict) -> str:
    rows = [
        [
            name,
            g["verdict"],
            g["metrics"]["top1_agreement"],
            g["metrics"]["kl_divergence"],
            g["metrics"]["greedy_match"],
            f"{g['bytes'] / 1e6:.0f}",
        ]
        for name, g in r["gate"].items()
    ]
    w = r["weights"]
    return "\n\n".join(
        [
            "## SmolLM2 int4: the GGUF's own Q4_1 blocks vs re-quantizing them",
            f"`python -m benchmarks.llm_int4` — {r['note']}. MatMul weights as the recipe "
            f"writes them: {w['codecs']}, max |dW| per kind {w['max_abs_error']}; MatMul "
            f"bytes {w['matmul_bytes_fp32'] / 1e6:.0f} MB fp32 -> "
            f"{w['matmul_bytes_after'] / 1e6:.0f} MB.",
            table(["variant", "gate", "top-1", "KL", "greedy match", "file MB"], rows),
            "\n".join(f"- {line}" for line in r["reading"]),
        ]
    )


if __name__ == "__main__":
    main()
