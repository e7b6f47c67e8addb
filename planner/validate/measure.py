"""One checked configuration run through router + workers on this machine: a closed loop
for its saturation throughput, then an open loop at half of it for its p99, with the
workers' own statistics and every process's CPU sampled between the loops; then the row
that sets the predictions (predict.py) against them."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from devmesh.processes import LocalMesh
from loadtest.calls import closed_loop, open_loop
from loadtest.llm import prompts as prompt_source
from loadtest.llm import runner as llm_runner
from perfmodel.analysis import analyse_file
from perfmodel.profiles import Profile
from perfmodel.roofline import diagnose
from planner import probe
from planner.calibrate import Calibration
from planner.serving import (
    ServingCalibration,
    batch_totals,
    encoder_request,
    model_statistics,
)
from planner.validate.configs import (
    BEST,
    MAX_TOKENS,
    PROMPT,
    TOKENS,
    WORKER_ARGS,
    Config,
    repository,
)
from planner.validate.predict import predictions
from protos import grpc_service_pb2 as pb

Sample = Callable[[], dict]  # the workers' totals, our CPU seconds, the host's, the time


def worker_totals(workers: list[str], model: str) -> dict:
    """The workers' own statistics so far: runs, rows and compute ns summed over them, and
    the achieved FLOP/s and bytes/s each reports (worker/roofline.py)."""
    runs = rows = ns = 0
    achieved: dict[str, list[float]] = {}
    for address in workers:
        reply = model_statistics(address, model)
        r, w, n = batch_totals(reply)
        runs, rows, ns = runs + r, rows + w, ns + n
        for s in reply.model_stats:
            for m in s.memory_usage:
                achieved.setdefault(m.type.removeprefix("meshserve.roofline."), []).append(
                    m.byte_size
                )
    return {"runs": runs, "rows": rows, "ns": ns, "achieved": achieved}


def worker_runs(before: dict, after: dict) -> dict:
    """Runs, rows per run, compute ms per run and host CPU per call between two samples."""
    runs = after["runs"] - before["runs"]
    rows = after["rows"] - before["rows"]
    ns = after["ns"] - before["ns"]
    cpu_s = after["cpu_s"] - before["cpu_s"]
    wall = after["at"] - before["at"]
    busy = probe.busy_cores(before["host"], after["host"])
    return {
        "runs": runs,
        "mean_batch": rows / runs if runs else 0.0,
        "run_ms": ns / runs / 1e6 if runs else 0.0,
        # every process of ours (client, router, workers, Redis) per call served
        "host_cpu_ms_per_call": cpu_s / rows * 1e3 if rows else 0.0,
        # other jobs' cores meanwhile: the host's busy cores less ours (the prediction
        # takes other jobs' demand as probed before the row; a row they crowded shows here)
        "other_cores": round(max(0.0, busy - cpu_s / wall), 3) if wall > 0 else 0.0,
        "reported": {k: statistics.mean(v) for k, v in after["achieved"].items()},
    }


def closed_callers(c: Config) -> int:
    """Enough callers that no replica's queue runs dry at saturation: four full batches per
    replica (one running, one queued, two crossing client and router: with two per replica
    the workers formed batches of 4-6 of 8), at least 8 (a batch limit of 1 still needs calls
    queued behind the one running while the rest cross the mesh), at most 64."""
    return min(64, max(8, 4 * c.replicas * c.max_batch))


@dataclass
class Loops:
    """The closed loop, the open loop's rate and its p99, and the samples around them."""

    closed: dict
    rate: float
    p99_ms: float
    opened: dict
    after_closed: dict
    start: dict = field(default_factory=dict)  # set by served_loops, before either loop
    end: dict = field(default_factory=dict)  # and after both


async def measure_encoder(
    router: str, request: pb.ModelInferRequest, c: Config, seconds: float, stats: Sample
) -> Loops:
    closed = await closed_loop(router, request, closed_callers(c), seconds)
    after_closed = stats()
    rate = max(1.0, 0.5 * closed["throughput_rps"])
    opened = await open_loop(router, request, rate, seconds)
    return Loops(closed, rate, opened["p99_ms"], opened, after_closed)


async def measure_llm(
    router: str, c: Config, seconds: float, tokenizer_path: Path, stats: Sample
) -> Loops:
    tokenizer = prompt_source.load_tokenizer(tokenizer_path)
    prompts = prompt_source.synthetic([PROMPT] * 8, tokenizer, seed=3)
    load = llm_runner.LLMLoad(
        router,
        c.model,
        prompts,
        MAX_TOKENS,
        sampling={"temperature": 0, "ignore_eos": True},
        duration=seconds,
        timeout=120.0,
        tokenizer=tokenizer,
    )
    # A generation takes about a second here: longer windows than the encoder's, and enough
    # of them in the open loop for a p99 to mean something: ~250 arrivals (bounded: 200 s).
    # With 30, the p99 was the largest of them, well below the true one; with 100, an M/D/1
    # queue at half load (1.3 calls/s of 0.385 s, the 1-sequence row) gives a p99 anywhere
    # from 1.04 to 1.96 s (10th-90th percentile of 300 simulated runs; the true one 1.68 s).
    load = replace(load, duration=3 * seconds)
    closed = await llm_runner.closed_loop(load, 2 * c.max_batch)
    after_closed = stats()
    rate = max(0.05, 0.5 * closed["throughput_rps"])
    load = replace(load, duration=min(200.0, max(3 * seconds, 250 / rate)))
    opened = await llm_runner.open_loop(load, rate)
    return Loops(closed, rate, opened["e2e_ms"]["p99"], opened, after_closed)


def run_config(
    c: Config,
    tmp: Path,
    profile: Profile,
    seconds: float,
    cache: Path,
    seen: dict,
    calibrations: dict[str, Calibration],
    servings: dict[str, ServingCalibration],
) -> dict:
    """Predict, run, compare one configuration; `seen` collects the analyses for the plots."""
    repo = repository(tmp, c, cache)
    a = seen[c.key] = seen.get(c.key) or analyse_file(
        repo / c.model / "1" / "model.onnx", c.model, "1"
    )
    # Other jobs' CPU demand now, while nothing of ours runs: the host this run shares.
    profile = replace(profile, background_cores=probe.background_cores(2.0))
    loops = served_loops(c, tmp, repo, seconds)
    closed, opened = loops.closed, loops.opened
    thr, p99 = closed["throughput_rps"], loops.p99_ms
    if not thr or not p99:
        raise RuntimeError(f"{c.label}: no call completed in the measured window: {opened}")
    meas = {
        "throughput_rps": thr,
        "closed_callers": closed["concurrency"],
        "offered_rps": loops.rate,
        "p99_ms": p99,
        "background_cores": round(profile.background_cores, 3),
        "open_loop_client": opened.get("client"),
        "closed": worker_runs(loops.start, loops.after_closed),
        "open": worker_runs(loops.after_closed, loops.end),
    }
    row = {
        "config": c.label,
        "measured": meas,
        **predictions(c, a, profile, meas, calibrations[c.key], servings.get(c.key)),
        "errors": {**closed.get("errors", {}), **opened.get("errors", {})},
        "diagnosis": diagnose(a, profile, c.max_batch, PROMPT, threads=1).row(),
    }
    print_row(c, row)
    return row


def served_loops(c: Config, tmp: Path, repo: Path, seconds: float) -> Loops:
    """`c` served by its workers behind a router (and Redis), put through both loops."""
    mesh = LocalMesh(tmp / "logs" / c.label.replace(" ", "_"), worker_args=WORKER_ARGS)
    mesh.start_redis()
    try:
        workers = [mesh.add_worker(repo) for _ in range(c.replicas)]
        mesh.wait_registered(c.replicas, timeout=120)
        router = mesh.start_router()
        processes = [*mesh.workers.values(), mesh.router, mesh.redis_server]
        pids = [p.popen.pid for p in processes if p is not None and p.popen is not None]

        def stats() -> dict:
            return {
                **worker_totals(workers, c.model),
                "cpu_s": probe.cpu_seconds(pids),
                "host": probe.host_cpu(),
                "at": time.monotonic(),
            }

        start = stats()
        if c.llm:
            tokenizer = repo / c.model / "tokenizer.json"
            loops = asyncio.run(measure_llm(router, c, seconds, tokenizer, stats))
        else:
            request = encoder_request(repo / c.model / "1" / "model.onnx", c.model, TOKENS)
            loops = asyncio.run(measure_encoder(router, request, c, seconds, stats))
        loops.start, loops.end = start, stats()
        return loops
    finally:
        mesh.stop()


def print_row(c: Config, row: dict) -> None:
    m, r, k = row["measured"], row["roofline"], row[BEST]
    print(
        f"{c.label:<42} thr meas {m['throughput_rps']:7.2f} roofline {r['capacity_rps']:8.2f} "
        f"({r['throughput_error']:+.0%}) {BEST} {k['capacity_rps']:8.2f} "
        f"({k['throughput_error']:+.0%}); p99 @ {m['offered_rps']:.2f}/s meas "
        f"{m['p99_ms']:8.1f} roofline {r['p99_ms']:8.1f} ({r['p99_error']:+.0%}) {BEST} "
        f"{k['p99_ms']:8.1f} ({k['p99_error']:+.0%})",
        flush=True,
    )
