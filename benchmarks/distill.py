"""Distillation beside quantization: teacher fp32 / int8 against student fp32 / int8.

    python -m benchmarks.distill [--model minilm smollm2] [--repeats 30] [--layers K] [--quick]

Per model: size, onnxruntime CPU latency (MiniLM: one forward pass of 16-token sentences
at batch 1 and 16; SmolLM2: one engine decode step at batch 1 and 16), all four measured
in alternation, and the gate's metrics of each against the fp32 teacher with the verdict
of its own recipe's gate. The students are the default plans of quantize/distill.py,
trained (under the bench lock) on first use into build/quantize and reused after.
Target (issue 16, MiniLM): student int8 >= 4x teacher fp32 at batch 16 with mean cosine
>= 0.95 and the evaluation set's rankings kept. Writes benchmarks/results/distill.json;
a model not named in --model keeps its entry from the previous file (each entry states
its own repeats), so re-measuring MiniLM does not retrain or drop SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import Tokenizer

from benchmarks.common import RESULTS, ROOT, check, figure, machine, parse, write_result
from quantize import distill, evaluate, pipeline
from quantize.recipes import DECODER, ENCODER, distill_recipe

TEACHER_INT8 = {ENCODER: "encoder-int8-dynamic", DECODER: "decoder-int8-weight-only"}
TARGET_SPEEDUP = 4.0
TARGET_COSINE = 0.95


def artifacts(model: str, cache: Path, layers: int | None) -> dict[str, pipeline.Artifact]:
    kind = pipeline.source(model).kind
    layers = layers or distill.DEFAULTS[kind].layers
    names = {
        "teacher fp32": pipeline.FP32,
        "teacher int8": TEACHER_INT8[kind],
        "student fp32": distill_recipe(kind, layers, False).name,
        "student int8": distill_recipe(kind, layers, True).name,
    }
    out = {"teacher fp32": pipeline.export_model(model, cache)}
    for label, recipe in list(names.items())[1:]:
        t0 = time.perf_counter()
        out[label] = pipeline.quantize_model(model, recipe, cache)
        print(f"{model} {label} ({recipe}): ready in {time.perf_counter() - t0:.0f} s")
    return out


def gate(recipe: str, metrics: dict) -> dict:
    r = pipeline.recipe_named(recipe)
    failures = [t.describe(metrics[t.metric]) for t in r.gate if not t.passes(metrics[t.metric])]
    return {"recipe": recipe, "accepted": not failures, "failures": failures}


def bench_model(model: str, repeats: int, cache: Path, layers: int | None = None) -> dict:
    kind = pipeline.source(model).kind
    found = artifacts(model, cache, layers)
    recipes = {label: a.folder.name.removeprefix("engine-") for label, a in found.items()}
    paths = {label: a.model for label, a in found.items()}
    teacher = found["teacher fp32"]
    tokenizer = Tokenizer.from_file(str(teacher.tokenizer))
    vocab = tokenizer.get_vocab_size()
    latency: dict[str, dict] = {}
    for batch in (1, 16):
        if kind == ENCODER:
            latency[f"batch_{batch}"] = evaluate.encoder_latency(paths, batch, vocab, repeats)
        else:
            steps = evaluate.decoder_latency(paths, batch, vocab, max(3, repeats // 3))
            latency[f"batch_{batch}"] = {k: v["decode_step_ms"] for k, v in steps.items()}
    metrics, verdicts = {}, {}
    for label, path in list(paths.items())[1:]:
        if kind == ENCODER:
            m = evaluate.evaluate_encoder(teacher.model, path, tokenizer, "CPUExecutionProvider")
        else:
            m = evaluate.evaluate_decoder(teacher.model, path, tokenizer, "CPUExecutionProvider")
        metrics[label] = m
        verdicts[label] = gate(recipes[label], m)
        print(f"{model} {label}: {m} {verdicts[label]}")
    speedup = {
        batch: {k: round(per["teacher fp32"] / v, 2) for k, v in per.items()}
        for batch, per in latency.items()
    }
    student_file = found["student fp32"].folder / pipeline.STUDENT_FILE
    student = json.loads(student_file.read_text())
    result = {
        "kind": kind,
        "repeats": repeats,
        "recipes": recipes,
        "size_bytes": {k: p.stat().st_size for k, p in paths.items()},
        "latency_ms": latency,
        "latency_measures": "one forward pass of 16-token sentences"
        if kind == ENCODER
        else "one engine decode step (one new token per row after 32 cached)",
        "speedup_vs_teacher_fp32": speedup,
        "metrics": metrics,
        "gate": verdicts,
        "student": {k: v for k, v in student.items() if k != "losses"},
    }
    if kind == ENCODER:
        s = metrics["student int8"]
        result["target"] = {
            "speedup_batch_16": speedup["batch_16"]["student int8"],
            "mean_cosine": s["mean_cosine"],
            "triplet_order_kept": s["triplet_order_kept"],
            "met": speedup["batch_16"]["student int8"] >= TARGET_SPEEDUP
            and s["mean_cosine"] >= TARGET_COSINE
            and s["triplet_order_kept"] == 1.0,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", nargs="+", default=["minilm"], choices=sorted(pipeline.SOURCES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cache", type=Path, default=ROOT / "build" / "quantize")
    parser.add_argument(
        "--layers", type=int, help="the student's layers, for one --model (default: its plan's)"
    )
    args = parse(parser, repeats=3)
    if args.layers is not None and len(args.model) != 1:
        parser.error("--layers needs exactly one --model")
    previous = RESULTS / "distill.json"
    old = json.loads(previous.read_text()) if previous.exists() else {"models": {}}
    kept = {m: {"repeats": old.get("repeats"), **v} for m, v in old["models"].items()}
    measured = {m: bench_model(m, args.repeats, args.cache, args.layers) for m in args.model}
    models = {m: measured.get(m, v) for m, v in kept.items()} | measured
    payload = {"benchmark": "distill", "machine": machine(), "models": models}
    path: Path = write_result("distill", payload, TITLE, rows(payload), args.quick)
    print(f"wrote {path}")


TITLE = "Distillation beside quantization (teacher vs student, fp32 vs int8)"


def rows(r: dict) -> list[list]:
    """Headline rows per model: the student int8's speedup at batch 16 and its quality, with
    the encoder's targets."""
    out = []
    for model, m in r["models"].items():
        t = m.get("target")
        speedup = m["speedup_vs_teacher_fp32"]["batch_16"]
        if t is None:
            out += [
                figure(f"{model}: {k} / teacher fp32 speed at batch 16", v, "x")
                for k, v in speedup.items()
                if k != "teacher fp32"
            ]
            continue
        out += [
            check(
                f"{model}: student int8 / teacher fp32 speed at batch 16",
                t["speedup_batch_16"],
                TARGET_SPEEDUP,
                False,
                "x",
            ),
            check(f"{model}: student int8 mean cosine", t["mean_cosine"], TARGET_COSINE, False),
            check(f"{model}: student int8 triplet order kept", t["triplet_order_kept"], 1.0, False),
        ]
    return out


if __name__ == "__main__":
    main()
