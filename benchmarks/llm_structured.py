"""Structured output (worker/llm/guided.py) on SmolLM2-135M instruct, the served int8 graph,
in-process engine: writes results/llm_structured.json.

(a) `answers` json_schema-constrained answers (a handful of varied schemas and prompts,
    sampled at temperature 0.7 with a seed each) and the fraction that validate against
    their schema with jsonschema (target: all);
(b) decode tok/s at `streams` concurrent streams with a JSON schema against the same
    streams without one (target >= 0.9x): every stream runs to max_tokens (ignore_eos, a
    schema whose one string cannot close sooner), greedy, in alternating rounds;
(c) the per-token cost of a mask and its advance (compute the next token's mask, commit
    the token) in llguidance and xgrammar, over SmolLM2's real tokenizer, on the canonical
    tokens of a JSON text and of regex matches, plus each library's compile time and what
    importing it costs a worker (xgrammar imports torch): the measurement behind the
    library choice (llguidance; docs in worker/llm/guided.py). xgrammar is measured when
    installed (it is not a dependency: `pip install --no-deps xgrammar==0.2.8
    apache-tvm-ffi==0.1.11`).

`--quick`: 20 answers, one short round each way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from benchmarks.common import write_result
from devmesh.processes import ROOT
from loadtest.results import machine

SCHEMAS: list[tuple[str, dict]] = [
    (
        "Describe {x} as a person in JSON.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "Give the weather in {x} as JSON.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "temperature": {"type": "number"},
                "unit": {"enum": ["C", "F"]},
                "sunny": {"type": "boolean"},
            },
            "required": ["city", "temperature", "unit", "sunny"],
            "additionalProperties": False,
        },
    ),
    (
        "List up to three facts about {x} in JSON.",
        {
            "type": "object",
            "properties": {
                "topic": {"type": "string", "maxLength": 40},
                "facts": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 60},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["topic", "facts"],
            "additionalProperties": False,
        },
    ),
    (
        "Rate {x} from 1 to 5 in JSON, with a one-line reason.",
        {
            "type": "object",
            "properties": {
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "reason": {"type": "string", "maxLength": 80},
            },
            "required": ["rating", "reason"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a book about {x} as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "author": {"type": "string", "maxLength": 40},
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science"]}},
            },
            "required": ["title", "author", "year"],
            "additionalProperties": False,
        },
    ),
]
SUBJECTS = ("Paris", "a cat", "the sea", "Alice", "a robot", "Tokyo", "music", "winter")
LONG = {  # a string that cannot close within the measured tokens
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
}
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# (c): canonical texts for each grammar
MASK_CASES: list[tuple[str, Any, Any]] = [
    ("json", SCHEMAS[0][1], {"name": "Alice Smith", "age": 42}),
    ("json", SCHEMAS[1][1], {"city": "Paris", "temperature": 21.5, "unit": "C", "sunny": True}),
    ("json", SCHEMAS[2][1], {"topic": "the sea", "facts": ["It is salty.", "It is deep."]}),
    ("regex", r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
    ("regex", r"[A-Z][a-z]+ (is|was) [a-z ]{5,40}\.", "Paris is a very pretty city indeed."),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--answers", type=int, default=200)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="per stream, in (b)")
    p.add_argument("--rounds", type=int, default=4, help="of each way, in (b)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=("answers", "throughput", "masks"), help="one part alone")
    args = p.parse_args(argv)
    if args.quick:
        args.answers, args.tokens, args.rounds = 20, 32, 1
    return args


def model_folder(path: Path) -> Path:
    from quantize import llm

    if not (path / llm.MODEL / "config.pbtxt").exists():
        llm.build(path, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
    return path / llm.MODEL


def engine(folder: Path, threads: int, seqs: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    from worker.llm.engine import Engine, EngineConfig
    from worker.llm.model import StepModel
    from worker.runtime import RuntimeOptions

    model = StepModel.load(
        folder / "1" / "model.onnx",
        RuntimeOptions(intra_op_threads=threads, allow_spinning=False),
        ["CPUExecutionProvider"],
    )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = EngineConfig(max_model_len=512, max_num_seqs=seqs, kv_cache_tokens=seqs * 512)
    return Engine(model, tokenizer, config), tokenizer


async def run_one(eng, prompt: list[int], params) -> tuple[str, str, int]:  # type: ignore[no-untyped-def]
    text, reason, tokens = [], "", 0
    async for out in eng.stream(eng.add(prompt, params)):
        text.append(out.text)
        reason, tokens = out.finish_reason or reason, out.completion_tokens
    return "".join(text), reason, tokens


async def answers(folder: Path, args: argparse.Namespace) -> dict:
    """(a): every answer parsed and validated against its schema."""
    from worker.llm.sampling import build

    eng, tokenizer = engine(folder, args.threads, args.streams)
    eng.start()
    try:
        await asyncio.to_thread(eng.vocab.ready)
        jobs = []
        for i in range(args.answers):
            question, schema = SCHEMAS[i % len(SCHEMAS)]
            prompt = tokenizer.encode(CHAT.format(question.format(x=SUBJECTS[i % 8]))).ids
            values = {"temperature": 0.7, "seed": i, "max_tokens": 200, "guided_json": schema}
            jobs.append((schema, run_one(eng, prompt, build(values, 400))))
        start = time.perf_counter()
        done = await asyncio.gather(*(job for _, job in jobs))
        seconds = time.perf_counter() - start
    finally:
        await eng.close()
    valid, failures, reasons = 0, [], dict[str, int]()
    for (schema, _), (text, reason, _tokens) in zip(jobs, done, strict=True):
        reasons[reason] = reasons.get(reason, 0) + 1
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append({"text": text[:300], "reason": reason, "error": str(e)[:200]})
    tokens = sum(t for _, _, t in done)
    return {
        "answers": len(done),
        "valid": valid,
        "fraction_valid": valid / len(done),
        "finish_reasons": reasons,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "failures": failures[:10],
        "examples": [text for _, (text, _, _) in zip(range(5), done, strict=False)],
    }


async def throughput(folder: Path, args: argparse.Namespace) -> dict:
    """(b): decode tok/s of `streams` streams to max_tokens, with the schema and without,
    alternating, in one engine; the rate counts tokens after each stream's first."""
    from worker.llm.sampling import build

    eng, tokenizer = engine(folder, args.threads, args.streams)
    eng.start()
    rates: dict[str, list[float]] = {"none": [], "schema": []}
    model_ms: dict[str, list[float]] = {"none": [], "schema": []}  # decode runs' ms a token
    try:
        await asyncio.to_thread(eng.vocab.ready)
        prompts = [
            tokenizer.encode(CHAT.format(f"Tell a story about {SUBJECTS[i % 8]}, in JSON.")).ids
            for i in range(args.streams)
        ]
        base = {"temperature": 0, "max_tokens": args.tokens, "ignore_eos": True}
        # a cold round first (the prompts then come from the prefix cache for both ways),
        # then ABBA rounds: neither way always runs first while the machine's load drifts
        order = ["none"] + [w for i in range(args.rounds) for w in _abba(i)]
        for i, way in enumerate(order):
            values = {**base, "guided_json": LONG} if way == "schema" else base
            params = build(values, 400)
            before = (eng.stats.decode_tokens, eng.stats.decode_ns)
            start = time.perf_counter()
            done = await asyncio.gather(*(run_one(eng, p, params) for p in prompts))
            wall = time.perf_counter() - start
            assert all(t == args.tokens for _, _, t in done), "a stream ended early"
            decoded = eng.stats.decode_tokens - before[0]
            if i:  # the cold round is not counted
                rates[way].append(decoded / wall)
                model_ms[way].append((eng.stats.decode_ns - before[1]) / 1e6 / decoded)
    finally:
        await eng.close()
    none, schema = statistics.median(rates["none"]), statistics.median(rates["schema"])
    # each round's two ways ran back to back: their ratio is what the load drifts least in
    pairs = [s / n for s, n in zip(rates["schema"], rates["none"], strict=True)]
    return {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "tok_s": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        "decode_run_ms_per_token": {k: [round(r, 3) for r in v] for k, v in model_ms.items()},
        "median_tok_s_none": round(none, 1),
        "median_tok_s_schema": round(schema, 1),
        "ratio_per_round": [round(r, 3) for r in pairs],
        "ratio": round(statistics.median(pairs), 3),
    }


def _abba(i: int) -> list[str]:
    return ["none", "schema"] if i % 2 else ["schema", "none"]


def mask_cost(reps: int = 5) -> dict:
    """(c): per-token mask + advance in each library (µs: median, p90), compile (ms)."""
    from gguf import GGUFReader

    from quantize import weights

    tokenizer = weights.gguf_tokenizer(GGUFReader(str(weights.smollm2_gguf())))
    libs = {"llguidance": _llguidance(tokenizer)}
    try:
        libs["xgrammar"] = _xgrammar(tokenizer)
    except ImportError as e:
        libs["xgrammar"] = None
        print(f"xgrammar not measured: {e}", file=sys.stderr)
    out: dict[str, Any] = {"cases": []}
    per_lib: dict[str, list[float]] = {name: [] for name, lib in libs.items() if lib}
    for kind, spec, sample in MASK_CASES:
        text = json.dumps(sample, separators=(",", ":")) if kind == "json" else sample
        ids = tokenizer.encode(text).ids
        row: dict[str, Any] = {"kind": kind, "tokens": len(ids)}
        for name, lib in libs.items():
            if lib is None:
                continue
            per, compiles = [], []
            for _ in range(reps):
                start = time.perf_counter()
                step = lib(kind, spec)
                compiles.append(time.perf_counter() - start)
                for t in ids:
                    start = time.perf_counter()
                    step(t)
                    per.append(time.perf_counter() - start)
            per_lib[name].extend(per)
            row[name] = {
                "median_us": round(statistics.median(per) * 1e6, 1),
                "p90_us": round(float(np.percentile(per, 90)) * 1e6, 1),
                "compile_ms": round(statistics.median(compiles) * 1e3, 2),
            }
        out["cases"].append(row)
    out["median_us"] = {k: round(statistics.median(v) * 1e6, 1) for k, v in per_lib.items()}
    out["mean_us"] = {k: round(statistics.fmean(v) * 1e6, 1) for k, v in per_lib.items()}
    out["import"] = {name: _import_cost(name) for name, lib in libs.items() if lib}
    return out


def _llguidance(tokenizer):  # type: ignore[no-untyped-def]
    import llguidance
    import llguidance.numpy as lnp

    lt = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=49152, eos_token=[0, 2])

    def start(kind: str, spec: Any):  # type: ignore[no-untyped-def]
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(spec), defaults={"whitespace_flexible": False}
            )
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        mask = lnp.allocate_token_bitmask(1, 49152)

        def step(token: int) -> None:
            lnp.fill_next_token_bitmask(m, mask)
            assert m.consume_token(token), token

        return step

    return start


def _xgrammar(tokenizer):  # type: ignore[no-untyped-def]
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer), vocab_size=49152, stop_token_ids=[0, 2]
    )

    def start(kind: str, spec: Any):  # type: ignore[no-untyped-def]
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if kind == "json":
            compiled = compiler.compile_json_schema(
                json.dumps(spec), any_whitespace=False, separators=(",", ":")
            )
        else:
            compiled = compiler.compile_regex(spec)
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, 49152)

        def step(token: int) -> None:
            m.fill_next_token_bitmask(mask)
            assert m.accept_token(token), token

        return step

    return start


def _import_cost(module: str) -> dict:
    """Seconds to import the library in a fresh interpreter, and whether torch came too."""
    code = (
        "import sys, time; t = time.perf_counter(); import " + module + "; "
        "print(time.perf_counter() - t, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return {"seconds": round(float(out[0]), 2), "imports_torch": out[1] == "True"}


TITLE = "Structured output: valid answers, decode cost, mask cost per library"


def summary_rows(result: dict) -> list[list]:
    a, b, c = result["answers"], result["throughput"], result["mask_cost"]
    rows = [
        [
            "json_schema answers that validate",
            f"{a['valid']}/{a['answers']} ({a['fraction_valid']:.1%})",
            "100%",
            "met" if a["valid"] == a["answers"] else "missed",
        ],
        [
            f"decode tok/s at {b['streams']} streams, schema / none",
            f"{b['ratio']:.2f}x (median of rounds {b['ratio_per_round']}; "
            f"{b['median_tok_s_schema']} / {b['median_tok_s_none']} tok/s)",
            ">= 0.9x",
            "met" if b["ratio"] >= 0.9 else "missed",
        ],
    ]
    for name, us in c["median_us"].items():
        imp = c["import"][name]
        torch = ", imports torch" if imp["imports_torch"] else ""
        value = f"{us} us (import {imp['seconds']} s{torch})"
        rows.append([f"{name}: mask + advance per token (median)", value, "", ""])
    load = result["load_average"]
    rows.append(
        [
            f"load average ({os.cpu_count()} cores shared with other engineers' work)",
            f"{load[0]:.1f} at the start, {load[1]:.1f} at the end",
            "",
            "",
        ]
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_load = os.getloadavg()[0]
    result: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    if args.only in (None, "masks"):
        result["mask_cost"] = mask_cost(2 if args.quick else 5)
        print(json.dumps(result["mask_cost"]["median_us"]))
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp))
        if args.only in (None, "answers"):
            result["answers"] = asyncio.run(answers(folder, args))
            print(f"valid {result['answers']['valid']}/{result['answers']['answers']}")
        if args.only in (None, "throughput"):
            result["throughput"] = asyncio.run(throughput(folder, args))
            print(json.dumps(result["throughput"]))
    result["load_average"] = [start_load, os.getloadavg()[0]]
    if args.only:  # a part alone is printed, not written over the whole run's file
        return 0
    rows = summary_rows(result)
    for row in rows:
        print(" | ".join(str(x) for x in row))
    print(f"wrote {write_result('llm_structured', result, TITLE, rows, quick=args.quick)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
