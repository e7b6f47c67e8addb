"""A shard group without gRPC: N rank processes run one model on given inputs, timed.

    python -m worker.tp.local --model-repository DIR --model M --tp N --inputs in.npz \
        --output out.npz [--repeat 20] [--warmup 3]                      # an encoder
    python -m worker.tp.local --model-repository DIR --model M --tp N \
        --requests requests.json --tokenizer tokenizer.json --output out.json  # an LLM

`run_group` starts the N processes and returns rank 0's outputs: for an encoder the
sentence_embedding and per repetition total_ns / compute_ns (onnxruntime) / comm_ns
(collectives, including waiting for the slowest rank); for an LLM, rank 0 runs the engine
(worker/llm/engine.py over worker/tp/llm_step.py) on the requests (`run_llm_group`; see
`drive` for their format) and returns each one's tokens, text and error with the time and
step counts. `--fail-rank R --fail-step S` makes rank R raise in its S-th step (tests of
failure containment). For the equality tests and benchmarks/tp.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common.net import free_port
from common.shard_format import ENCODER
from worker.runtime import RuntimeOptions, requested_providers
from worker.tp.load import load_rank
from worker.tp.parallel import TpGroup, destroy_tp_group, init_tp_group
from worker.tp.runtime import find_shard_sets


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker.tp.local", description=__doc__)
    p.add_argument("--model-repository", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--providers", default="cpu")
    p.add_argument("--intra-op-threads", type=int, default=1)
    p.add_argument("--inputs", type=Path, help="an encoder's input_ids / attention_mask (.npz)")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--requests", type=Path, help="an LLM's requests (.json, see drive)")
    p.add_argument("--tokenizer", type=Path, help="an LLM's tokenizer.json")
    p.add_argument("--engine-config", default="{}", help="EngineConfig fields as JSON")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    options = RuntimeOptions(providers=a.providers, intra_op_threads=a.intra_op_threads)
    (shards,) = [s for s in find_shard_sets(a.model_repository, a.tp) if s.model == a.model]
    model = load_rank(shards, a.rank, options, requested_providers(a.providers))
    group = init_tp_group(a.rank, a.tp, a.backend, "127.0.0.1", a.master_port, 60.0)
    if shards.kind == ENCODER:
        encode(a, model, group)
    else:
        if a.rank == a.fail_rank:
            inject_failure(model, a.fail_step)
        llm(a, model, group)
    destroy_tp_group()
    return 0


def encode(a: argparse.Namespace, model, group: TpGroup) -> None:  # type: ignore[no-untyped-def]
    feeds = dict(np.load(a.inputs))
    totals, computes, comms = [], [], []
    out: dict[str, np.ndarray] = {}
    for i in range(a.warmup + a.repeat):
        model.timing.reset()
        t0 = time.perf_counter_ns()
        out = {
            "sentence_embedding": model.encode(group, feeds["input_ids"], feeds["attention_mask"])
        }
        if i >= a.warmup:
            totals.append(time.perf_counter_ns() - t0)
            computes.append(model.timing.compute_ns)
            comms.append(model.timing.comm_ns)
    if a.rank == 0:
        np.savez(
            a.output,
            **out,  # type: ignore[arg-type]
            total_ns=np.array(totals),
            compute_ns=np.array(computes),
            comm_ns=np.array(comms),
            provider=np.array(model.provider),
            backend=np.array(group.backend),
        )


def inject_failure(model, step: int) -> None:  # type: ignore[no-untyped-def]
    """Make this rank's `step`-th step raise in its second segment."""
    run_segment = model.run_segment

    def failing(name, *args):  # type: ignore[no-untyped-def]
        if model.steps == step and name != "first":
            raise RuntimeError(f"injected failure on rank {model.rank}, step {step}")
        return run_segment(name, *args)

    model.run_segment = failing


def llm(a: argparse.Namespace, model, group: TpGroup) -> None:  # type: ignore[no-untyped-def]
    from worker.tp.leader import Leader, follow

    if a.rank != 0:
        follow([model], group)
        model.close()
        return
    from tokenizers import Tokenizer

    from worker.llm.engine import EngineConfig
    from worker.tp.llm_step import TPStepModel

    leader = Leader([model], group, [], heartbeat_s=3600.0)
    tokenizer = Tokenizer.from_file(str(a.tokenizer))
    config = EngineConfig(**json.loads(a.engine_config))
    requests = json.loads(a.requests.read_text())
    try:
        result = asyncio.run(run_engine(TPStepModel(model, leader, 0), tokenizer, config, requests))
    finally:
        leader.stop()
    result["backend"] = group.backend
    result["compute_ns"], result["comm_ns"] = model.timing.compute_ns, model.timing.comm_ns
    a.output.write_text(json.dumps(result))


async def run_engine(model, tokenizer, config, requests: list[list[dict]]) -> dict:  # type: ignore[no-untyped-def]
    """The engine over `model` (a StepModel or TPStepModel) on waves of requests."""
    from worker.llm.engine import Engine

    engine = Engine(model, tokenizer, config)
    engine.start()
    try:
        t0 = time.perf_counter()
        results, waves_seconds = [], []
        for wave in requests:
            start = time.perf_counter()
            results.append(await drive(engine, wave))
            waves_seconds.append(time.perf_counter() - start)
        seconds = time.perf_counter() - t0
    finally:
        await engine.close()
    s = engine.stats
    return {
        "results": results,
        "seconds": seconds,
        "waves_seconds": waves_seconds,
        "steps": s.steps,
        "decode_tokens": s.decode_tokens,
        "prefill_tokens": s.prefill_tokens,
        "joined_running": s.joined_running,
        "decode_batches": {str(k): v for k, v in s.decode_batches.items()},
    }


async def drive(engine, wave: list[dict]) -> list[dict]:  # type: ignore[no-untyped-def]
    """Run one wave of requests concurrently. A request: {"prompt": [ids] | "text": str,
    "max_tokens": n, "after": k (join once the wave's first request has k tokens),
    "params": {sampling keys}}; greedy and ignore_eos unless its params say otherwise.
    Each result: tokens, text, finish_reason, error."""
    from worker.llm import sampling

    first: list = []

    async def one(i: int, r: dict) -> dict:
        after = int(r.get("after", 0))
        for _ in range(60_000):  # bounded: at most a minute
            if not after or (first and len(first[0].tokens) >= after):
                break
            await asyncio.sleep(0.001)
        values = {"temperature": 0, "ignore_eos": True, "max_tokens": r["max_tokens"]}
        params = sampling.build({**values, **r.get("params", {})}, engine.config.max_model_len)
        prompt = r["prompt"] if "prompt" in r else engine.encode(r["text"])
        try:
            seq = engine.add(prompt, params)
        except Exception as e:
            return {"tokens": [], "text": "", "finish_reason": None, "error": str(e)}
        if i == 0:
            first.append(seq)
        pieces, last = [], None
        async for out in engine.stream(seq):
            pieces.append(out.text)
            last = out
        return {
            "tokens": list(seq.tokens),
            "text": "".join(pieces),
            "finish_reason": last.finish_reason if last else None,
            "error": last.error if last else None,
        }

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(wave))))


def _spawn(repository: Path, model: str, tp: int, args: list[str], timeout: float) -> None:
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.tp.local",
                "--model-repository",
                str(repository),
                "--model",
                model,
                "--tp",
                str(tp),
                "--rank",
                str(rank),
                "--master-port",
                str(port),
                *args,
            ],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        for rank in range(tp)
    ]
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"tp_local ranks exited with {codes}")


def run_group(
    repository: Path,
    model: str,
    tp: int,
    inputs: dict[str, np.ndarray],
    workdir: Path,
    *extra: str,
    timeout: float = 600.0,
) -> dict[str, np.ndarray]:
    """An encoder's outputs and timings from a group of `tp` processes."""
    workdir.mkdir(parents=True, exist_ok=True)
    np.savez(workdir / "inputs.npz", **inputs)  # type: ignore[arg-type]
    output = workdir / f"out-{model}-tp{tp}.npz"
    args = ["--inputs", str(workdir / "inputs.npz"), "--output", str(output), *extra]
    _spawn(repository, model, tp, args, timeout)
    with np.load(output) as data:
        return {k: data[k] for k in data.files}


def run_llm_group(
    repository: Path,
    model: str,
    tp: int,
    requests: list[list[dict]],
    tokenizer: Path,
    workdir: Path,
    *extra: str,
    engine_config: dict | None = None,
    timeout: float = 600.0,
) -> dict:
    """The engine on rank 0 of a group of `tp` processes, over waves of requests."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "requests.json").write_text(json.dumps(requests))
    output = workdir / f"out-{model}-tp{tp}.json"
    args = [
        *("--requests", str(workdir / "requests.json"), "--tokenizer", str(tokenizer)),
        *("--engine-config", json.dumps(engine_config or {}), "--output", str(output)),
        *extra,
    ]
    _spawn(repository, model, tp, args, timeout)
    return json.loads(output.read_text())  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
