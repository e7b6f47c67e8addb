"""Where a decode step's time goes, in-process: onnxruntime's own profiler on the served step
graph, one decode step of N rows at a time, as the worker runs it (2 intra-op threads, no
spinning, the greedy top-k path, every row `--context` tokens into its cache).

    python -m benchmarks.llm_profile --checkpoint qwen2.5-0.5b [--rows 1 16] [--quick]
    python -m benchmarks.llm_profile --model build/models/smollm2/1/model.onnx --name smollm2

Each node's kernel time is put in one bucket by what it computes, told by its shapes (the
optimizer renames fused nodes; shapes it keeps): the LM head (MatMulNBits with N = vocab),
q/k/v (one packed MatMulNBits), o, gate/up (packed), down, attention (GroupQueryAttention:
RoPE, the new keys and values written in place, attention over the cache), and the rest
(norms, SiLU, embedding, top-k). `step_ms` is the median wall time of an unprofiled step,
in another session of the same graph; `kernels_ms` the profiled kernels' sum a step. With
--checkpoint, a served single stream and bare one-row steps also take turns
(`served_vs_bare`): what the engine adds to a step. Each measurement first waits (at most
--quiet-wait-s) for the 1-minute load average to fall to --quiet-load, and records it.
Writes benchmarks/results/llm_profile_<name>.json (--quick: build/bench-quick/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks import llm_checkpoint
from benchmarks.common import figure, machine, parse, write_result
from benchmarks.llm import default_build_dir, load_avg, wait_quiet
from common import custom_ops, paths
from worker.llm.cache import KVCache, page_aligned
from worker.llm.model import StepModel
from worker.runtime import OnnxSession, RuntimeOptions

CPU = ["CPUExecutionProvider"]
BUCKETS = ("lm_head", "q/k/v", "o", "gate/up", "down", "attention", "other")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_profile", description=__doc__)
    p.add_argument("--checkpoint", choices=sorted(llm_checkpoint.CHECKPOINTS))
    p.add_argument("--model", type=Path, help="a step graph (model.onnx) instead")
    p.add_argument("--name", help="the results file's suffix (default: the checkpoint's)")
    p.add_argument("--llamacpp-venv", type=Path, default=default_build_dir() / "llamacpp-venv")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=256, help="tokens already cached per row")
    p.add_argument("--runs", type=int, default=20, help="steps timed (and profiled) per shape")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--served-rounds",
        type=int,
        default=5,
        help="with --checkpoint: rounds of a served single stream against bare steps (0: none)",
    )
    p.add_argument("--served-tokens", type=int, default=128)
    p.add_argument(
        "--quiet-load",
        type=float,
        default=float(os.cpu_count() or 2),
        help="before each measurement wait for the 1-minute load average to fall to this",
    )
    p.add_argument("--quiet-wait-s", type=float, default=120.0, help="at most this long")
    args = parse(p, argv, runs=4, served_rounds=2)
    if bool(args.checkpoint) == bool(args.model):
        p.error("give --checkpoint or --model")
    return args


def session(path: Path, threads: int, profile_prefix: str | None) -> StepModel:
    """The worker's session (worker/runtime.py: all graph optimizations, no spinning for an
    LLM), with onnxruntime's profiler on when `profile_prefix` is given."""
    options = RuntimeOptions(
        intra_op_threads=threads, allow_spinning=False, profile_prefix=profile_prefix
    )
    return StepModel(OnnxSession(path, options, CPU))


def new_cache(model: StepModel, slots: int, tokens: int) -> KVCache:
    f = model.facts
    max_len = page_aligned(tokens, f.kv_heads * f.head_dim, itemsize=f.cache_shape(1, 1).itemsize)
    return KVCache(f.cache_shape(slots, max_len))


# the nodes that read a quantized weight: onnxruntime's, and meshserve's 5-bit one
WEIGHT_OPS = ("MatMulNBits", custom_ops.MATMUL_Q)


def bucket(shapes: list[list[int]], out: list[int], model: StepModel, ffn: int) -> str:
    """A weight node's (WEIGHT_OPS) bucket from its activation's K and its output's N."""
    f = model.facts
    k, n = shapes[0][-1], out[-1]
    if n == f.vocab_size:
        return "lm_head"
    if n == (f.heads + 2 * f.kv_heads) * f.head_dim:
        return "q/k/v"
    if n == 2 * ffn:
        return "gate/up"
    if k == ffn:
        return "down"
    return "o"


def graph_facts(path: Path) -> tuple[int, int]:
    """(the intermediate size: the down projection's K; the bytes of every MatMul's weights,
    scales and zero points: what a one-row decode step reads besides the cache)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    sizes = {
        i.name: int(np.prod(i.dims)) * onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
        for i in proto.graph.initializer
    }
    ffn, weights = 0, set()
    for node in proto.graph.node:
        if node.op_type not in (*WEIGHT_OPS, "MatMul"):
            continue
        weights |= {i for i in node.input if i in sizes}  # a shared one counted once
        if node.op_type in WEIGHT_OPS and any(".down.weight" in i for i in node.input):
            ffn = next(int(a.i) for a in node.attribute if a.name == "K")
    if not ffn:
        raise ValueError(f"{path}: no down projection found")
    return ffn, sum(sizes[w] for w in weights)


def gguf_bytes(path: Path) -> int:
    """The bytes of a GGUF's tensors: what llama.cpp reads a one-row step (the tied
    embedding is its LM head, read whole; a separate one is looked up a row at a time)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" or tied)


def decode_step(model: StepModel, cache: KVCache, rows: int, context: int) -> None:
    ids = np.full((rows, 1), 1000, dtype=np.int64)
    model.run_top(cache, ids, np.full(rows, context + 1), 0, rows)


def wall_ms(model: StepModel, rows: int, context: int, runs: int) -> float:
    cache = new_cache(model, rows, context + 8)
    decode_step(model, cache, rows, context)  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        decode_step(model, cache, rows, context)
        times.append((time.perf_counter() - start) * 1000)
    cache.close()
    return round(statistics.median(times), 2)


def profiled(path: Path, rows: int, args: argparse.Namespace, ffn: int) -> dict:
    """Kernel ms per step by bucket (the mean over `runs` profiled steps after a warm-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = session(path, args.threads, str(Path(tmp) / "step"))
        cache = new_cache(model, rows, args.context + 8)
        decode_step(model, cache, rows, args.context)
        for _ in range(args.runs):
            decode_step(model, cache, rows, args.context)
        trace = json.loads(Path(model.session.session.end_profiling()).read_text())
        cache.close()
    model_runs = sorted((e for e in trace if e.get("name") == "model_run"), key=lambda e: e["ts"])
    runs = [e["dur"] / 1000 for e in model_runs[1:]]
    measured_from = model_runs[1]["ts"]  # the warm-up run's kernels are left out
    ms = dict.fromkeys(BUCKETS, 0.0)
    other: dict[str, float] = {}  # "other" by op type
    for e in trace:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if e["ts"] < measured_from:
            continue
        a = e.get("args", {})
        op = a.get("op_name", "?")
        if op in WEIGHT_OPS:
            shapes = [next(iter(s.values())) for s in a.get("input_type_shape", [])]
            out = next(iter(a["output_type_shape"][0].values()))
            ms[bucket(shapes, out, model, ffn)] += e["dur"] / 1000
        elif op == "GroupQueryAttention":
            ms["attention"] += e["dur"] / 1000
        else:
            ms["other"] += e["dur"] / 1000
            other[op] = other.get(op, 0.0) + e["dur"] / 1000
    steps = len(runs)
    per = {k: v / steps for k, v in ms.items()}
    total = sum(per.values())
    return {
        "kernels_ms": round(total, 2),
        "profiled_run_ms": round(statistics.median(runs), 2) if runs else None,
        "ms_by_part": {k: round(v, 3) for k, v in per.items()},
        "share_by_part": {k: round(v / total, 3) for k, v in per.items()},
        "other_ms_by_op": {
            k: round(v / steps, 3) for k, v in sorted(other.items(), key=lambda kv: -kv[1])
        },
    }


def served_vs_bare(
    prepared: llm_checkpoint.Prepared, plain: StepModel, args: argparse.Namespace
) -> dict:
    """What serving adds to a step: a worker on the checkpoint's repository streams one
    request of --served-tokens alone (benchmarks/llm_paired.py's single-stream round: ms a
    token after the first), and this process times bare one-row steps at the same context,
    taking turns round by round (the worker idle while the bare steps run)."""
    import asyncio

    from tokenizers import Tokenizer

    from benchmarks import llm_paired
    from benchmarks.common import standalone_worker
    from loadtest.llm import prompts as prompt_source
    from loadtest.llm.prompts import Prompt

    tok = Tokenizer.from_file(str(prepared.repository / prepared.model / "tokenizer.json"))
    n, tokens = args.served_rounds, args.served_tokens
    openers = prompt_source.synthetic([8] * n, tok, seed=3)
    short = prompt_source.synthetic([25] * n, tok, seed=1)
    context = 25 + tokens // 2  # a served token's mean cached length
    served: list[float] = []
    bare: list[float] = []
    logs = paths.build_dir() / "bench-llm-profile"
    logs.mkdir(parents=True, exist_ok=True)
    loads = []
    with standalone_worker(prepared.repository, logs) as address:
        side = llm_paired.Side("meshserve", address, "triton", prepared.model, 0)
        for r in range(n):
            loads.append(wait_quiet(args.quiet_load, args.quiet_wait_s)["load_avg"][0])
            opener = Prompt(openers[r].text, max_tokens=1)  # opens the connection
            job = llm_paired.single_round(side, opener, short[r], tokens, tok)
            rate = asyncio.run(job)["decode_tokens_per_s"]
            if rate:
                served.append(1000 / rate)
            bare.append(wall_ms(plain, 1, context, args.runs))
    return {
        "rounds": n,
        "tokens": tokens,
        "served_ms_a_token": [round(x, 2) for x in served],
        "bare_step_ms": bare,
        "served_ms_a_token_median": round(statistics.median(served), 2) if served else None,
        "bare_step_ms_median": round(statistics.median(bare), 2),
        "load_avg_before_each_round": loads,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf = None
    if args.checkpoint:
        prepared = llm_checkpoint.prepare(args.checkpoint, args.llamacpp_venv / "bin" / "python")
        path = prepared.repository / prepared.model / "1" / "model.onnx"
        gguf = prepared.gguf
    else:
        path = args.model
    name = args.name or args.checkpoint
    ffn, read = graph_facts(path)
    plain = session(path, args.threads, None)
    steps = {}
    for rows in args.rows:
        before = wait_quiet(args.quiet_load, args.quiet_wait_s)
        step = wall_ms(plain, rows, args.context, args.runs)
        steps[str(rows)] = {"step_ms": step, **profiled(path, rows, args, ffn)}
        steps[str(rows)]["load"] = {"before": before, "after": load_avg()}
        shares = steps[str(rows)]["share_by_part"]
        print(
            f"{rows} rows: {step} ms a step;", ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
        )
    result = {
        "benchmark": "llm_profile",
        "machine": machine(),
        "onnxruntime": ort.__version__,
        "model": str(path),
        "settings": {"threads": args.threads, "spinning": False, "context": args.context}
        | {"runs": args.runs},
        "weight_mb_read_a_step": round(read / 1e6, 1),
        "decode": steps,
    }
    if gguf is not None:
        result["gguf_tensor_mb"] = round(gguf_bytes(gguf) / 1e6, 1)
    if args.checkpoint and args.served_rounds:
        result["served_vs_bare"] = served_vs_bare(prepared, plain, args)
        print(result["served_vs_bare"])
    one = steps.get("1")
    if one:
        result["weight_gb_per_s_at_1_row"] = round(read / one["step_ms"] / 1e6, 1)
    title = f"Where a decode step's time goes ({name}: onnxruntime's profiler, 2 threads)"
    file = f"llm_profile_{name}"
    path_out = write_result("llm_profile", result, title, summary_rows(result), args.quick, file)
    print(f"wrote {path_out}")
    return 0


def summary_rows(result: dict) -> list[list]:
    steps = result["decode"]
    out = [figure("MatMul weights read a step (MB)", result["weight_mb_read_a_step"])]
    if "gguf_tensor_mb" in result:
        out.append(figure("llama.cpp: the GGUF's tensors (MB)", result["gguf_tensor_mb"]))
    served = result.get("served_vs_bare")
    if served and served["served_ms_a_token_median"]:
        out.append(figure("served single stream: ms a token", served["served_ms_a_token_median"]))
        out.append(figure("bare one-row step, same turns: ms", served["bare_step_ms_median"]))
    for n, s in steps.items():
        out.append(figure(f"decode {n} rows: ms a step", s["step_ms"]))
        parts = ", ".join(f"{k} {v:.0%}" for k, v in s["share_by_part"].items())
        out.append(figure(f"decode {n} rows: share of kernel time", parts))
    return out


if __name__ == "__main__":
    sys.exit(main())
