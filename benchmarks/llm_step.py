"""One engine step of the served SmolLM2 graph, timed in-process: what a decode step of N
rows costs, what a prefill chunk of T tokens costs, and so how large a step's token budget
(`meshserve.max_step_tokens`) may be for a chunk to stall running streams by at most about
two decode steps. Also reports the onnxruntime version and the thread settings, so runs
under two onnxruntime releases (or spinning on/off) compare side by side.

    python -m benchmarks.llm_step --model build/models/smollm2/1/model.onnx [--out NAME]

Rounds: every figure is the median of `--rounds` timed runs (after one warm-up run).
Writes benchmarks/results/NAME.json (default llm_step).

With `--compare OTHER.onnx ...`, the graphs run in one process and take turns run by run
(`compare`), so that a VM whose speed drifts by 20% over minutes (this one does) moves
every graph alike; spinning is off there, since idle sessions' spinning pools would take
the cores from the one running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import paths
from loadtest.results import machine, write_json
from worker.llm.cache import KVCache, page_aligned
from worker.llm.model import StepModel
from worker.runtime import OnnxSession, RuntimeOptions

CPU = ["CPUExecutionProvider"]


def write_result(name: str, payload: dict) -> Path:
    """results/NAME.json. (This module and benchmarks/llm_gpu.py import neither
    benchmarks.common nor the servers' packages: the GPU machine runs them with little
    more than onnxruntime, torch and this checkout.)"""
    return write_json(paths.results() / f"{name}.json", payload)


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
    return KVCache(f.cache_shape(slots, max_len), slots * max_len, device or model.cache_device)


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


def compare(paths: list[Path], options: RuntimeOptions, args: argparse.Namespace) -> dict:
    """Each graph's median ms for a decode step of each `--rows` and a prefill chunk of each
    `--chunks` (at `--context` cached tokens), the graphs taking turns: `--rounds` turns of
    3 runs of each graph per shape."""
    models = [StepModel.load(p, options, CPU) for p in paths]
    rng = np.random.default_rng(0)
    caches = filled_caches(models, args, rng)
    ctx = args.context
    shapes = [(f"decode_{r}_rows", r, 1) for r in args.rows]
    shapes += [(f"prefill_{n}", 1, n) for n in args.chunks]
    out: dict[str, dict[str, float]] = {str(p): {} for p in paths}
    for name, rows, new in shapes:
        ids = rng.integers(100, 40000, (rows, new))
        lengths = np.full(rows, ctx + new)
        times: list[list[float]] = [[] for _ in models]
        for turn in range(args.rounds + 1):
            for i, (model, cache) in enumerate(zip(models, caches, strict=True)):
                for _ in range(3):
                    start = time.perf_counter()
                    model.run(cache, ids, lengths, 0, rows)
                    if turn:  # the first turn warms up
                        times[i].append((time.perf_counter() - start) * 1000)
        for path, t in zip(paths, times, strict=True):
            out[str(path)][name] = round(statistics.median(t), 2)
    for cache in caches:
        cache.close()
    return out


def profile(path: Path, options: RuntimeOptions, folder: Path, context: int) -> dict:
    """onnxruntime's profile of one 8-row decode step and one 64-token prefill chunk: time
    per op type, largest first (ms, summed over the nodes of that type)."""
    folder.mkdir(parents=True, exist_ok=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.intra_op_threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_profiling = True
    so.profile_file_prefix = str(folder / "llm_step")
    out = {}
    for name, rows, n in (("decode_8_rows", 8, 1), ("prefill_64", 1, 64)):
        session = OnnxSession(path, options, CPU)
        session.session = ort.InferenceSession(str(path), sess_options=so, providers=CPU)
        model = StepModel(session)
        cache = new_cache(model, rows, context + n + 8)
        ids = np.full((rows, n), 1000)
        for _ in range(3):
            model.run(cache, ids, np.full(rows, context + n), 0, rows)
        trace = json.loads(Path(session.session.end_profiling()).read_text())
        cache.close()
        by_op: dict[str, float] = {}
        runs = 0
        for event in trace:
            if event.get("cat") == "Session" and event.get("name") == "model_run":
                runs += 1
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                op = event.get("args", {}).get("op_name", "?")
                by_op[op] = by_op.get(op, 0.0) + event["dur"] / 1000
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:8]
        out[name] = {
            "runs": runs,
            "ms_per_run_by_op": {op: round(ms / max(runs, 1), 2) for op, ms in top},
        }
    return out


def budget(result: dict, rows: int, stall_steps: float) -> int | None:
    """The largest chunk (of those measured) whose prefill run, added to a decode step of
    `rows` rows, keeps that step within (1 + stall_steps) decode steps."""
    step = result["decode_ms_by_rows"].get(str(rows))
    if step is None:
        return None
    fits = [int(n) for n, ms in result["prefill_ms_by_chunk"].items() if ms <= stall_steps * step]
    return max(fits) + rows if fits else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_step", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-spinning", action="store_true")
    p.add_argument("--context", type=int, default=256, help="tokens already cached per row")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="llm_step")
    p.add_argument("--profile", type=Path, help="also profile one step (trace files here)")
    p.add_argument(
        "--compare", type=Path, nargs="+", help="other graphs, taking turns with --model"
    )
    args = p.parse_args(argv)
    # taking turns, an idle session's spinning pool would take the cores from the one running
    spinning = not args.no_spinning and not args.compare
    options = RuntimeOptions(intra_op_threads=args.threads, allow_spinning=spinning)
    if args.compare:
        by_graph = compare([args.model, *args.compare], options, args)
        base = by_graph[str(args.model)]
        result = {
            "benchmark": "llm_step_compare",
            "machine": machine(),
            "onnxruntime": ort.__version__,
            "settings": {
                "threads": args.threads,
                "spinning": False,
                "context": args.context,
                "turns": args.rounds,
                "runs_per_turn": 3,
            },
            "ms_by_graph": by_graph,
            "reading": [
                f"{path}: "
                + ", ".join(f"{k} {ms} ms ({ms / base[k]:.2f}x)" for k, ms in by_shape.items())
                for path, by_shape in by_graph.items()
            ],
        }
        out = write_result(args.out, result)
        print("\n".join(result["reading"]))
        print(f"wrote {out}")
        return 0
    if args.profile:
        profiled = profile(args.model, options, args.profile, args.context)
        print(json.dumps(profiled, indent=1))
        path = write_result(
            args.out,
            {
                "benchmark": "llm_step_profile",
                "machine": machine(),
                "onnxruntime": ort.__version__,
                "note": "Shared 2-core machine (other agents' builds and tests ran alongside).",
                "profile": profiled,
            },
        )
        print(f"wrote {path}")
        return 0
    model = StepModel.load(args.model, options, CPU)
    result = {
        "benchmark": "llm_step",
        "machine": machine(),
        "note": "Shared 2-core machine (other agents' builds and tests ran alongside).",
        "onnxruntime": ort.__version__,
        "model": str(args.model),
        "settings": {
            "threads": args.threads,
            "spinning": not args.no_spinning,
            "context": args.context,
            "rounds": args.rounds,
        },
        **measure(model, args),
    }
    result["max_step_tokens"] = {f"rows_{r}": budget(result, r, 1.0) for r in args.rows if r > 1}
    d = result["decode_ms_by_rows"]
    result["reading"] = [
        f"onnxruntime {ort.__version__}, {args.threads} threads, spinning "
        f"{'off' if args.no_spinning else 'on'}: decode step {d.get('1')} ms at 1 row "
        f"({1000 / d['1']:.1f} tok/s), {d.get('16')} ms at 16 rows",
        "prefill ms by chunk: "
        + ", ".join(f"{n}: {ms}" for n, ms in result["prefill_ms_by_chunk"].items()),
    ]
    path = write_result(args.out, result)
    for line in result["reading"]:
        print(line)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
