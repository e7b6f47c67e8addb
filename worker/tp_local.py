"""A shard group without gRPC: N rank processes run one model on given inputs, timed.

    python -m worker.tp_local --model-repository DIR --model M --tp N --inputs in.npz \
        --output out.npz [--repeat 20] [--warmup 3] [--new-tokens 4]

`run_group` starts the N processes and returns rank 0's outputs: the model's outputs
(sentence_embedding, or output_ids plus logits_<step> for a decoder) and per repetition
total_ns / compute_ns (onnxruntime) / comm_ns (collectives, including waiting for the
slowest rank). For the equality tests and benchmarks/tp.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common.net import free_port
from worker.parallel import destroy_tp_group, init_tp_group
from worker.runtime import RuntimeOptions, requested_providers
from worker.tp_runtime import RankModel, find_shard_sets


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker.tp_local", description=__doc__)
    p.add_argument("--model-repository", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--providers", default="cpu")
    p.add_argument("--intra-op-threads", type=int, default=1)
    p.add_argument("--inputs", type=Path, required=True)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    options = RuntimeOptions(providers=a.providers, intra_op_threads=a.intra_op_threads)
    (shards,) = [s for s in find_shard_sets(a.model_repository, a.tp) if s.model == a.model]
    model = RankModel(shards, a.rank, options, requested_providers(a.providers))
    group = init_tp_group(a.rank, a.tp, a.backend, "127.0.0.1", a.master_port, 60.0)
    feeds = dict(np.load(a.inputs))
    totals, computes, comms = [], [], []
    out: dict[str, np.ndarray] = {}
    for i in range(a.warmup + a.repeat):
        model.timing.reset()
        t0 = time.perf_counter_ns()
        if shards.kind == "encoder":
            out = {
                "sentence_embedding": model.encode(
                    group, feeds["input_ids"], feeds["attention_mask"]
                )
            }
        else:
            tokens, steps = model.generate(group, feeds["input_ids"], a.new_tokens)
            out = {"output_ids": tokens, **{f"logits_{j}": s for j, s in enumerate(steps)}}
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
    destroy_tp_group()
    return 0


def run_group(
    repository: Path,
    model: str,
    tp: int,
    inputs: dict[str, np.ndarray],
    workdir: Path,
    *extra: str,
    timeout: float = 600.0,
) -> dict[str, np.ndarray]:
    workdir.mkdir(parents=True, exist_ok=True)
    np.savez(workdir / "inputs.npz", **inputs)  # type: ignore[arg-type]
    output = workdir / f"out-{model}-tp{tp}.npz"
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.tp_local",
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
                "--inputs",
                str(workdir / "inputs.npz"),
                "--output",
                str(output),
                *extra,
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
    with np.load(output) as data:
        return {k: data[k] for k in data.files}


if __name__ == "__main__":
    sys.exit(main())
