"""Speculative decoding in the LLM engine: SmolLM2 int8 (or fp32) as the target, with the distilled
15-layer student as its draft (k = 1..4), against the engine without a draft; and the target
as its own draft (every draft accepted: the upper bound on acceptance, and what the draft's
runs and the wider verify run cost when nothing is gained from them).

    python -m benchmarks.llm_speculative [--k 1 2 3 4] [--drafts student-int8 self]
                                         [--max-tokens 48] [--rounds 2]

Batch 1 (the engine speculates while one sequence decodes), greedy, fixed prompts, in
process (no gRPC), onnxruntime on CPU with --threads intra-op threads. Each configuration
generates every prompt in turn; configurations alternate over --rounds rounds and each
prompt's median time is kept. With a draft, both sessions run with intra-op threads not
spinning (as the worker loads them): two alternating pools that spin after each run take
the cores from each other. The target alone is measured both ways, and the speed-ups are
against it as served without a draft (spinning). Greedy output should equal the target's
own (checked per configuration: "same text"). Needs the student: `python -m quantize
distill --model smollm2 --layers 15 --steps 100` (its fp32 step graph; the int8 draft and
the target's all-positions graph are built here into build/quantize/smollm2/experiments/,
reused).
Writes benchmarks/results/llm_speculative.json (--target fp32: llm_speculative_fp32.json).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from tokenizers import Tokenizer

from benchmarks.common import ROOT, machine, write_result
from benchmarks.readings import table
from quantize import llm_graph, pipeline
from worker.llm.cache import KVCache
from worker.llm.engine import Engine, EngineConfig
from worker.llm.model import StepModel
from worker.llm.sampling import SamplingParams
from worker.llm.speculative import DraftConfig
from worker.runtime import RuntimeOptions

CACHE = ROOT / "build" / "quantize"
NOT_SPINNING = "target alone, threads not spinning"
INT8 = "decoder-int8-weight-only"
TARGETS = {"int8": INT8, "fp32": pipeline.FP32}
STUDENT = "decoder-distill-l15"
PROMPTS = [
    "The history of the printing press begins",
    "To make a good cup of tea, you should",
    "Photosynthesis is the process by which plants",
    "The three largest cities in Europe are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def experiment(name: str) -> Path:
    return CACHE / "smollm2" / "experiments" / name / "model.onnx"


def verify_graph(source: Path) -> Path:
    """`source` with logits at every new position (llm_graph.with_position_logits)."""
    path = experiment(f"verify-{source.parent.name}")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        proto = llm_graph.with_position_logits(onnx.load(str(source)))
        onnx.save(proto, str(path))
    return path


def int8_graph(source: Path) -> Path:
    path = experiment(f"int8-{source.parent.name}")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        recipe = pipeline.recipe_named(INT8)
        assert recipe.apply is not None
        pipeline._quiet_quantizers()
        recipe.apply(source, path)
    return path


def run_costs(models: dict[str, StepModel], reps: int = 10) -> dict[str, dict[int, float]]:
    """Median ms of one run with M = 1, 2, 3, 5 new tokens after 64 cached ones, per model:
    what a decode step (M = 1), a draft's catch-up (M = 2) and a verify run (M = k + 1)
    each cost."""
    out: dict[str, dict[int, float]] = {}
    for name, model in models.items():
        f = model.facts
        cache = KVCache(f.cache_shape(1, 128), 128)
        model.run(cache, np.arange(1000, 1064)[None], np.asarray([64]), 0, 1)
        out[name] = {}
        for m in (1, 2, 3, 5):
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                model.run(cache, np.arange(2000, 2000 + m)[None], np.asarray([64 + m]), 0, 1)
                times.append((time.perf_counter() - start) * 1e3)
            out[name][m] = round(statistics.median(times), 2)
        cache.close()
    return out


async def generate(
    model: StepModel, draft: DraftConfig | None, tokenizer: Tokenizer, max_tokens: int
) -> list[dict]:
    """Each prompt alone: its tokens, time to the first token and total time."""
    engine = Engine(
        model,
        tokenizer,
        EngineConfig(max_model_len=512, max_num_seqs=1, kv_cache_tokens=512),
        draft=draft,
    )
    engine.start()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = []
    try:
        for prompt in PROMPTS:
            before = (engine.stats.draft_tokens, engine.stats.accepted_tokens)
            before_runs, before_draft_ns = engine.stats.decode_runs, engine.stats.draft_ns
            start = time.perf_counter()
            seq = engine.add(engine.encode(prompt), params)
            first = None
            async for out in engine.stream(seq):
                if first is None and out.completion_tokens:
                    first = time.perf_counter() - start
            total = time.perf_counter() - start
            runs.append(
                {
                    "tokens": list(seq.tokens),
                    "ttft_s": first,
                    "total_s": total,
                    "proposed": engine.stats.draft_tokens - before[0],
                    "accepted": engine.stats.accepted_tokens - before[1],
                    "target_decode_runs": engine.stats.decode_runs - before_runs,
                    "draft_s": (engine.stats.draft_ns - before_draft_ns) / 1e9,
                }
            )
    finally:
        await engine.close()
    return runs


def summarize(rounds: list[list[dict]], baseline: list[dict] | None) -> dict:
    """Per prompt, the median over rounds; totals over prompts."""
    per_prompt = list(zip(*rounds, strict=True))
    decode_s = sum(statistics.median(r["total_s"] - r["ttft_s"] for r in p) for p in per_prompt)
    total_s = sum(statistics.median(r["total_s"] for r in p) for p in per_prompt)
    draft_s = sum(statistics.median(r["draft_s"] for r in p) for p in per_prompt)
    first = rounds[0]
    tokens = sum(len(r["tokens"]) for r in first)
    decoded = sum(len(r["tokens"]) - 1 for r in first)
    proposed = sum(r["proposed"] for r in first)
    accepted = sum(r["accepted"] for r in first)
    runs = sum(r["target_decode_runs"] for r in first)
    out = {
        "completion_tokens": tokens,
        "total_s": round(total_s, 3),
        "decode_s": round(decode_s, 3),
        "decode_tokens_per_s": round(decoded / decode_s, 2),
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "tokens_per_target_run": round(decoded / runs, 3) if runs else None,
        "draft_share_of_decode": round(draft_s / decode_s, 3),
        "identical_to_target": baseline is None
        or all(r["tokens"] == b["tokens"] for r, b in zip(first, baseline, strict=True)),
    }
    return out


@dataclass
class _Models:
    """The sessions the configurations run: the target as served (spinning), as a draft's
    partner (not spinning), its all-positions verify graph, and the drafts by name."""

    target_file: Path
    draft_files: dict[str, Path]
    tokenizer: Tokenizer
    served: StepModel
    plain: StepModel
    verifying: StepModel
    drafts: dict[str, StepModel]


def main() -> None:
    args = _parse_args()
    loadavg_before = Path("/proc/loadavg").read_text().split()[:3]
    models = _load_models(args)
    drafts = {n: m for n, m in models.drafts.items() if n != "self"}
    costs = run_costs({"target": models.plain, **drafts})
    print("run ms by new tokens:", costs, flush=True)
    configs: list[tuple[str, str | None, int]] = [("target alone", None, 0)]
    configs += [(NOT_SPINNING, None, 0)]
    configs += [(f"{d} k={k}", d, k) for d in args.drafts for k in args.k]
    started = time.perf_counter()
    rounds = _alternate(configs, models, args.rounds, args.max_tokens)
    baseline = rounds["target alone"][0]
    results = {name: summarize(rounds[name], baseline) for name, _, _ in configs}
    base = results["target alone"]["decode_tokens_per_s"]
    for r in results.values():
        r["decode_speedup"] = round(r["decode_tokens_per_s"] / base, 3)
    reading = _reading(results, costs)
    payload = {
        "machine": machine(),
        "command": "python -m benchmarks.llm_speculative " + " ".join(sys.argv[1:]),
        "settings": _settings(args, models),
        "loadavg_before": loadavg_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "seconds": round(time.perf_counter() - started, 1),
        "run_ms_by_new_tokens": costs,
        "results": results,
        "reading": reading,
    }
    name = "llm_speculative" if args.target == "int8" else f"llm_speculative_{args.target}"
    print(write_result(name, payload))
    for line in reading:
        print("-", line)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--drafts",
        nargs="+",
        default=["student-int8", "self"],
        help="student-int8 student-fp32 self",
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", choices=sorted(TARGETS), default="int8")
    return parser.parse_args()


def _load_models(args: argparse.Namespace) -> _Models:
    target_file = pipeline.artifact_for(CACHE, "smollm2", TARGETS[args.target]).model
    student = pipeline.artifact_for(CACHE, "smollm2", STUDENT)
    if not student.exists():
        raise SystemExit(
            f"no student at {student.folder}: run `python -m quantize distill --model smollm2 "
            "--layers 15 --steps 100` first"
        )
    # Alternating sessions run with spinning off (as the worker loads a target with a
    # draft): a pool spinning after its run takes the cores from the other's. The target
    # alone is measured both ways; "target alone" is as served without a draft (spinning).
    options = RuntimeOptions(intra_op_threads=args.threads, allow_spinning=False)
    spinning = RuntimeOptions(intra_op_threads=args.threads)
    cpu = ["CPUExecutionProvider"]
    tokenizer = Tokenizer.from_file(str(student.tokenizer))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    served = StepModel.load(target_file, spinning, cpu)
    plain = StepModel.load(target_file, options, cpu)
    verifying = StepModel.load(verify_graph(target_file), options, cpu)
    draft_files = {
        "student-fp32": student.model,
        "student-int8": int8_graph(student.model),
        "self": target_file,
    }
    drafts = {
        name: plain if name == "self" else StepModel.load(draft_files[name], options, cpu)
        for name in args.drafts
    }
    return _Models(target_file, draft_files, tokenizer, served, plain, verifying, drafts)


def _alternate(
    configs: list[tuple[str, str | None, int]], models: _Models, rounds: int, max_tokens: int
) -> dict[str, list[list[dict]]]:
    """Every configuration's runs, round by round, the order rotated each round."""
    out: dict[str, list[list[dict]]] = {name: [] for name, _, _ in configs}
    for i in range(rounds):
        order = configs[i % len(configs) :] + configs[: i % len(configs)]  # rotate the order
        for name, draft, k in order:
            if draft:
                model = models.verifying
            else:
                model = models.served if name == "target alone" else models.plain
            drafting = None if draft is None else DraftConfig(models.drafts[draft], k)
            runs = asyncio.run(generate(model, drafting, models.tokenizer, max_tokens))
            out[name].append(runs)
            print(name, f"round {i}", round(sum(r["total_s"] for r in runs), 2), "s", flush=True)
    return out


def _reading(results: dict[str, dict], costs: dict[str, dict[int, float]]) -> list[str]:
    """The conclusions, computed from the figures."""
    base = results["target alone"]["decode_tokens_per_s"]
    best = max(results, key=lambda n: results[n]["decode_speedup"])
    students = {n: r for n, r in results.items() if n.startswith("student")}
    reading = [
        f"fastest: {best} at {results[best]['decode_speedup']}x the target's decode "
        f"tokens/s ({results[best]['decode_tokens_per_s']} vs {base})",
    ]
    if students:
        top = max(students, key=lambda n: students[n]["decode_speedup"])
        rates = sorted({r["acceptance_rate"] for r in students.values()})
        reading.append(
            f"the distilled student's drafts were accepted at {rates[0]}..{rates[-1]}; its best "
            f"setting ({top}) ran at {students[top]['decode_speedup']}x"
        )
    if any(n.startswith("self") for n in results):
        selfs = {n: r for n, r in results.items() if n.startswith("self")}
        top = max(selfs, key=lambda n: selfs[n]["decode_speedup"])
        rates = sorted(r["acceptance_rate"] for r in selfs.values())
        reading.append(
            f"the target as its own draft (acceptance {rates[0]}..{rates[-1]}) ran at "
            f"{selfs[top]['decode_speedup']}x at best ({top}): the price of drafting with a "
            "model as costly as the target"
        )
    t = costs["target"]
    reading.append(
        f"one target run costs {t[1]} ms with 1 new token, {t[2]} ms with 2 and {t[5]} ms "
        f"with 5 (after 64 cached tokens): a verify run of k + 1 tokens costs "
        f"{round(t[5] / t[1], 2)}x a decode step at k = 4"
    )
    reading.append(
        "all outputs identical to the target's"
        if all(r["identical_to_target"] for r in results.values())
        else "some outputs differ from the target's: "
        + ", ".join(n for n, r in results.items() if not r["identical_to_target"])
    )
    return reading


def _settings(args: argparse.Namespace, models: _Models) -> dict:
    return {
        "target": str(models.target_file.relative_to(ROOT)),
        "target_kind": args.target,
        "drafts": {n: str(models.draft_files[n].relative_to(ROOT)) for n in args.drafts},
        "prompts": PROMPTS,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "intra_op_threads": args.threads,
        "batch": 1,
        "sampling": "greedy",
    }


# ---- benchmarks/README.md: this benchmark's section (python -m benchmarks.summary) ----


def section(r: dict) -> str:
    rows = [
        [
            name,
            "-" if v["acceptance_rate"] is None else v["acceptance_rate"],
            "-" if v["tokens_per_target_run"] is None else v["tokens_per_target_run"],
            v["decode_tokens_per_s"],
            f"{v['decode_speedup']}x",
            v["draft_share_of_decode"],
            "yes" if v["identical_to_target"] else "no",
        ]
        for name, v in r["results"].items()
    ]
    s = r["settings"]
    return "\n\n".join(
        [
            f"## LLM: speculative decoding with a draft model ({s['target_kind']} target)",
            f"`{r['command'].strip()}` — target `{s['target']}`, drafts "
            + ", ".join(f"{n}: `{p}`" for n, p in s["drafts"].items())
            + f"; batch {s['batch']}, {s['sampling']}, {len(s['prompts'])} prompts of up to "
            f"{s['max_tokens']} new tokens, median of {s['rounds']} rounds, "
            f"{s['intra_op_threads']} intra-op threads; loadavg {' '.join(r['loadavg_before'])} "
            f"before, {' '.join(r['loadavg_after'])} after.",
            table(
                [
                    "configuration",
                    "acceptance",
                    "tokens per target run",
                    "decode tok/s",
                    "speed-up",
                    "draft share of decode time",
                    "same text as the target",
                ],
                rows,
            ),
            "\n".join(f"- {line}" for line in r["reading"]),
        ]
    )


if __name__ == "__main__":
    main()
