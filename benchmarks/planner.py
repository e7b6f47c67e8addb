"""Issue 14, item 6: the planner's predictions against the real mesh on this machine.

    python -m benchmarks.planner [--seconds 5] [--skip-llm] [--reanalyse]

First `planner probe --mesh` measures this machine's roof and the mesh's own cost per call
(its CPU per call, the router's part of it, and the trip's p99 at three open-loop rates with
the cores each kept busy). Then each model x recipe is calibrated twice, outside the mesh:
its session timed alone (planner/calibrate.py: batch 1 and the largest, one thread as the
workers run it), and, for the encoders, served through a one-worker mesh at batch limits 2
and twice the largest checked (planner/serving.py: seconds per batch and host CPU per call at
saturation; no checked configuration is a calibration point). Then,
for each configuration (MiniLM fp32 / int8, 1-3 workers, two batch limits; SmolLM2 int8
weight-only through the LLM engine at two batch limits), it predicts three times (the bare
Roofline on the probed profile; fitted to the session alone; fitted to the one-worker mesh,
"served", the planner's best and the one judged) and measures:
- throughput: predicted capacity (saturation throughput) against a closed loop with enough
  callers to keep every replica's queue from running dry (4 x replicas x max batch, at
  least 8, at most 64);
- p99: predicted at an open-loop Poisson rate of half the measured throughput (stated in
  each row as offered_rps), against that run.
The workers' own statistics are read after each loop, so the batch the batcher formed and
its run time are known for the closed and the open loop apart. Workers and router share this
machine's cores with the client, so the prediction uses the shared-host form of the queueing
model (planner/queueing.py). Every miss of the best prediction gets the reason the numbers
show: the batches, a replica's seconds per batch, the host CPU per call, the cores the open
loop kept busy. Writes benchmarks/results/planner.json, planner_roofline.png (this machine)
and planner_roofline_h200.png (the same models on the H200 profile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.common import RESULTS, closed_loop, machine, open_loop, write_result
from benchmarks.readings import table
from devmesh.processes import LocalMesh
from loadtest.llm import prompts as prompt_source
from loadtest.llm import runner as llm_runner
from planner import probe, profiles
from planner.analysis import ModelAnalysis, analyse_file
from planner.calibrate import Calibration, calibrate, refit
from planner.plan import Workload, service_time
from planner.plot import roofline_png
from planner.profiles import Profile
from planner.queueing import Prediction, between, predict
from planner.roofline import diagnose, run_seconds
from planner.serving import (
    ServingCalibration,
    batch_totals,
    calibrate_serving,
    encoder_request,
    model_statistics,
    served_profile,
)
from protos import grpc_service_pb2 as pb
from quantize import llm, pipeline

CACHE = Path("build/quantize")
WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")
TOKENS = 16  # MiniLM items: 16 tokens (the TEXT padding unit)
PROMPT, MAX_TOKENS = 64, 32  # SmolLM2 calls
STEP_CONTEXT = PROMPT + MAX_TOKENS // 2  # a decode step's mean context
TARGETS = {"throughput": 0.20, "p99": 0.30}
BEST = "served"  # the prediction judged against the targets


@dataclass(frozen=True)
class Config:
    model: str
    recipe: str
    replicas: int
    max_batch: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.recipe} x{self.replicas} b{self.max_batch}"


CONFIGS = [
    Config("minilm", "fp32", 1, 8),
    Config("minilm", "encoder-int8-dynamic", 1, 8),
    Config("minilm", "encoder-int8-dynamic", 2, 8),
    Config("minilm", "encoder-int8-dynamic", 3, 8),
    Config("minilm", "encoder-int8-dynamic", 1, 1),
    Config("smollm2", "decoder-int8-weight-only", 1, 4),
    Config("smollm2", "decoder-int8-weight-only", 1, 1),
]


def artifact(model: str, recipe: str, cache: Path) -> Path:
    """The recipe's ONNX file in the quantize cache; built there (and gated) when missing."""
    found = pipeline.artifact_for(cache, model, recipe)
    if found.exists():
        return found.model
    if model == "smollm2":
        llm.build(Path(tempfile.mkdtemp()), recipe, cache)
    elif recipe == pipeline.FP32:
        pipeline.export_model(model, cache)
    else:
        pipeline.quantize_model(model, recipe, cache)
    return found.model


def repository(root: Path, c: Config, cache: Path) -> Path:
    folder = root / c.label.replace(" ", "_") / c.model
    (folder / "1").mkdir(parents=True)
    src = artifact(c.model, c.recipe, cache)
    try:  # a hard link when on the same disk: no second copy
        (folder / "1" / "model.onnx").hardlink_to(src)
    except OSError:
        shutil.copy(src, folder / "1" / "model.onnx")
    if c.model == "smollm2":
        shutil.copy(src.parent / "tokenizer.json", folder / "tokenizer.json")
        text = llm.config_text(c.model, c.recipe, 2048)
        seqs = f'value {{ string_value: "{c.max_batch}" }}'
        text += f'parameters {{ key: "meshserve.max_num_seqs" {seqs} }}\n'
    else:
        text = (
            f'name: "{c.model}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {c.max_batch}\n'
            "dynamic_batching { default_queue_policy { max_queue_size: 1024 } }\n"
            f'parameters {{ key: "meshserve.version.1" value {{ string_value: "{c.recipe}" }} }}\n'
        )
    (folder / "config.pbtxt").write_text(text)
    return folder.parent


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


def predicted(
    c: Config,
    a: ModelAnalysis,
    profile: Profile,
    offered: float,
    prefill_s: float | None = None,
    served: bool = False,
) -> tuple[dict, float]:
    """The planner's prediction at `offered` calls/s, and its capacity. `prefill_s`: a
    decoder's prefill as the calibration run timed it. `served`: `profile` is fitted to a
    one-worker mesh serving the model (served_profile): its S(b) already holds the wait for a
    core, and the mesh trip's p99 is the probe's at the cores this load keeps busy."""
    llm_call = c.model == "smollm2"
    w = Workload(offered, 1.0, PROMPT if llm_call else TOKENS, MAX_TOKENS if llm_call else 0)
    service = service_time(a, profile, w, tp=1, threads=1, prefill_s=prefill_s)

    def at(trip_p99: float) -> Prediction:
        return predict(
            offered,
            c.replicas,
            c.max_batch,
            service,
            profile.mesh_latency_s,
            host_cores=profile.cores,
            cpu_per_call_s=profile.mesh_cpu_s,
            threads_per_replica=1,
            mesh_max_rps=profile.mesh_max_rps,
            background_cores=profile.background_cores,
            mesh_latency_p99_s=trip_p99,
            open_cpu=profile.open_cpu(),
            continuous=llm_call,
            contended=served,
        )

    p = at(profile.mesh_latency_p99_s)
    extra = {}
    if served:
        # the cores busy: other jobs', and the open loop's fixed part and CPU per call beside
        # the run as the one-worker mesh measured them under Poisson arrivals, plus the
        # run's share at this batch
        per_call = profile.mesh_open_cpu_s + between(service, p.batch) / p.batch
        busy = profile.background_cores + profile.mesh_open_cores + offered * per_call
        trip = profile.trip_p99(busy)
        p = at(trip)
        extra = {"busy_cores": busy, "trip_p99_ms": trip * 1e3}
    return {
        "capacity_rps": p.capacity_rps,
        "limit": p.limit,
        "saturation_batch": p.saturation_batch,
        "run_ms_at_saturation": run_ms(c, a, profile, p.saturation_batch),
        "batch": p.batch,
        "run_ms": run_ms(c, a, profile, max(1, round(p.batch))),
        "p99_ms": p.p99_s * 1e3,
        **extra,
    }, p.capacity_rps


def run_ms(c: Config, a: ModelAnalysis, profile: Profile, batch: int) -> float:
    """One session run as the worker times it: an encoder call, or a decoder's decode step."""
    return run_seconds(a, profile, batch, STEP_CONTEXT, 1, 1, TOKENS) * 1e3


def predictions(
    c: Config,
    a: ModelAnalysis,
    profile: Profile,
    m: dict,
    cal: Calibration,
    serving: ServingCalibration | None,
) -> dict:
    """The three predictions of one row against its measurement `m`, and why the best one
    missed. An LLM row has no serving calibration: its best is the calibrated one."""
    used = cal.profile(profile)
    out = {
        "roofline": compare(c, a, profile, m, None),
        "calibrated": compare(c, a, used, m, cal.prefill_s or None),
    }
    out[BEST] = out["calibrated"]
    if serving:
        used = served_profile(profile, serving, a, c.max_batch, TOKENS)
        out[BEST] = compare(c, a, used, m, None, served=True)
    out["explanation"] = explain(c, out[BEST], m, used) if missed(out[BEST]) else []
    return out


def compare(  # type: ignore[no-untyped-def]
    c: Config,
    a: ModelAnalysis,
    profile: Profile,
    m: dict,
    prefill_s: float | None,
    served: bool = False,
):
    """One prediction against the measurement `m`: the row's figures and its errors."""
    pred, capacity = predicted(c, a, profile, m["offered_rps"], prefill_s, served)
    pred = {k: round(v, 3) if isinstance(v, float) else v for k, v in pred.items()}
    return {
        **pred,
        "throughput_error": round((capacity - m["throughput_rps"]) / m["throughput_rps"], 3),
        "p99_error": round((pred["p99_ms"] - m["p99_ms"]) / m["p99_ms"], 3),
    }


def summarize(rows: list[dict]) -> dict:
    def medians(key: str) -> dict:
        t = round(statistics.median(abs(r[key]["throughput_error"]) for r in rows), 3)
        p = round(statistics.median(abs(r[key]["p99_error"]) for r in rows), 3)
        return {
            "median_abs_throughput_error": t,
            "median_abs_p99_error": p,
            "met": {"throughput": t <= TARGETS["throughput"], "p99": p <= TARGETS["p99"]},
            "misses": [r["config"] for r in rows if missed(r[key])],
        }

    return {
        "configurations": len(rows),
        "targets": TARGETS,
        "roofline": medians("roofline"),
        "calibrated": medians("calibrated"),
        BEST: medians(BEST),
    }


def missed(prediction: dict) -> bool:
    return (
        abs(prediction["throughput_error"]) > TARGETS["throughput"]
        or abs(prediction["p99_error"]) > TARGETS["p99"]
    )


def closed_callers(c: Config) -> int:
    """Enough callers that no replica's queue runs dry at saturation: four full batches per
    replica (one running, one queued, two crossing client and router: with two per replica
    the workers formed batches of 4-6 of 8), at least 8 (a batch limit of 1 still needs calls
    queued behind the one running while the rest cross the mesh), at most 64."""
    return min(64, max(8, 4 * c.replicas * c.max_batch))


async def measure_encoder(
    router: str, request: pb.ModelInferRequest, c: Config, seconds: float, stats
):  # type: ignore[no-untyped-def]
    closed = await closed_loop(router, request, closed_callers(c), seconds)
    after_closed = stats()
    rate = max(1.0, 0.5 * closed["throughput_rps"])
    opened = await open_loop(router, request, rate, seconds)
    return closed, rate, opened["p99_ms"], opened, after_closed


async def measure_llm(router: str, c: Config, seconds: float, tokenizer_path: Path, stats):  # type: ignore[no-untyped-def]
    tokenizer = prompt_source.load_tokenizer(tokenizer_path)
    prompts = prompt_source.synthetic([PROMPT] * 8, tokenizer, seed=3)
    load = llm_runner.LLMLoad(
        router,
        "smollm2",
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
    return closed, rate, opened["e2e_ms"]["p99"], opened, after_closed


def explain(c: Config, pred: dict, meas: dict, profile: Profile) -> list[str]:
    """Why the best prediction missed, from the numbers: the batches, the replicas' seconds
    per batch, the host's CPU per call, the cores the open loop kept busy, or the mesh
    around them. `profile`: the one the prediction was made with."""
    why = []
    closed, opened = meas["closed"], meas["open"]
    llm = c.model == "smollm2"
    if closed["runs"] and not llm:
        batch, expected = closed["mean_batch"], pred["saturation_batch"]
        if abs(batch - expected) > max(1.0, 0.25 * expected):
            why.append(
                f"closed loop: the batcher formed batches of {batch:.1f} on average where the "
                f"prediction has {expected}"
            )
        # a replica's seconds per batch, run and the work between runs: replicas x batch / rps
        cycle = c.replicas * batch / meas["throughput_rps"] * 1e3
        ratio = cycle / pred["run_ms_at_saturation"]
        if abs(ratio - 1) > 0.2:
            why.append(
                f"closed loop: a replica took {cycle:.2f} ms per batch of {batch:.1f} (its run "
                f"{closed['run_ms']:.2f} ms) against {pred['run_ms_at_saturation']:.2f} ms "
                f"predicted for {expected} ({ratio:.2f}x)"
            )
        expected_cpu = profile.mesh_cpu_s * 1e3 + pred["run_ms_at_saturation"] / max(1, expected)
        used = closed["host_cpu_ms_per_call"]
        if used and abs(used / expected_cpu - 1) > 0.2:
            why.append(
                f"closed loop: client, router, workers and Redis used {used:.2f} ms of CPU per "
                f"call against {expected_cpu:.2f} ms predicted"
            )
    if "busy_cores" in pred and opened["runs"]:
        busy = meas["offered_rps"] * opened["host_cpu_ms_per_call"] / 1e3
        busy += meas["background_cores"]
        if abs(busy - pred["busy_cores"]) > 0.1:
            tail = profile.trip_p99(busy) * 1e3
            why.append(
                f"open loop: the host's cores were {busy:.2f} busy (ours and other jobs') "
                f"against {pred['busy_cores']:.2f} predicted"
                + (
                    f", so the trip's tail there is {tail:.1f} ms, not {pred['trip_p99_ms']:.1f}"
                    if abs(tail - pred["trip_p99_ms"]) > 0.1 * pred["trip_p99_ms"]
                    else ""
                )
            )
    for loop, figures in (("closed", closed), ("open", opened)):
        other = figures.get("other_cores", 0.0)
        if other > meas["background_cores"] + 0.2:
            why.append(
                f"{loop} loop: other jobs on this machine took {other:.2f} cores meanwhile, "
                f"where {meas['background_cores']:.2f} was measured before the row"
            )
    if llm:
        why.append(
            "a generation's end-to-end time carries 32 streamed messages through the router "
            "beside its 64-token prefill and decode steps, which the calibration times alone"
        )
    if pred["limit"] != "replicas":
        why.append(
            f"predicted capacity limited by {pred['limit']} (CPU per call beside the run "
            f"{profile.mesh_cpu_s * 1e3:.2f} ms; the mesh at most {profile.mesh_max_rps:.0f} "
            "calls/s)"
        )
    if not why:
        why.append(
            "the batches, cycles and CPU match the prediction, so the rest is the mesh around "
            "them: router, gRPC and client share the cores with the workers (and with other "
            "jobs on this machine), beyond the probe's averages"
        )
    return why


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
    path = repo / c.model / "1" / "model.onnx"
    key = f"{c.model} {c.recipe}"
    a = seen[key] = seen.get(key) or analyse_file(path, c.model, "1")
    # Other jobs' CPU demand now, while nothing of ours runs: the host this run shares.
    profile = replace(profile, background_cores=probe.background_cores(2.0))
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

        if c.model == "smollm2":
            closed, rate, p99, opened, after_closed = asyncio.run(
                measure_llm(router, c, seconds, repo / c.model / "tokenizer.json", stats)
            )
        else:
            closed, rate, p99, opened, after_closed = asyncio.run(
                measure_encoder(router, encoder_request(path, c.model, TOKENS), c, seconds, stats)
            )
        end = stats()
    finally:
        mesh.stop()
    thr = closed["throughput_rps"]
    if not thr or not p99:
        raise RuntimeError(f"{c.label}: no call completed in the measured window: {opened}")
    meas = {
        "throughput_rps": thr,
        "closed_callers": closed["concurrency"],
        "offered_rps": rate,
        "p99_ms": p99,
        "background_cores": round(profile.background_cores, 3),
        "open_loop_client": opened.get("client"),
        "closed": worker_runs(start, after_closed),
        "open": worker_runs(after_closed, end),
    }
    row = {
        "config": c.label,
        "measured": meas,
        **predictions(c, a, profile, meas, calibrations[key], servings.get(key)),
        "errors": {**closed.get("errors", {}), **opened.get("errors", {})},
        "diagnosis": diagnose(a, profile, c.max_batch, PROMPT, threads=1).row(),
    }
    r, k = row["roofline"], row[BEST]
    print(
        f"{c.label:<42} thr meas {thr:7.2f} roofline {r['capacity_rps']:8.2f} "
        f"({r['throughput_error']:+.0%}) {BEST} {k['capacity_rps']:8.2f} "
        f"({k['throughput_error']:+.0%}); p99 @ {rate:.2f}/s meas {p99:8.1f} roofline "
        f"{r['p99_ms']:8.1f} ({r['p99_error']:+.0%}) {BEST} {k['p99_ms']:8.1f} "
        f"({k['p99_error']:+.0%})",
        flush=True,
    )
    return row


def plots(rows: list[dict], analyses: dict[str, ModelAnalysis], local: Profile) -> None:
    for profile, name in (
        (local, "planner_roofline.png"),
        (profiles.load("H200"), "planner_roofline_h200.png"),
    ):
        points = [
            diagnose(a, profile, b, PROMPT, threads=1 if profile.kind == "cpu" else None)
            for a in analyses.values()
            for b in (1, 8, 64)
        ]
        measured = []
        if profile is local:
            for r in rows:
                closed = r["measured"]["closed"]
                rep = closed["reported"]
                a = analyses[r["config"].split(" x")[0]]
                b = max(1, round(closed["mean_batch"]))
                if rep.get("achieved_flops_per_s"):
                    measured.append(
                        (r["config"], a.intensity(b, PROMPT, TOKENS), rep["achieved_flops_per_s"])
                    )
        roofline_png(profile, points, RESULTS / name, measured)


def calibrations_for(
    configs: list[Config], profile: Profile, cache: Path, analyses: dict[str, ModelAnalysis]
) -> dict[str, Calibration]:
    """Each model x recipe timed alone at batch 1 and its configurations' largest batch."""
    out = {}
    for key in dict.fromkeys(f"{c.model} {c.recipe}" for c in configs):
        model, recipe = key.split(" ")
        top = max(c.max_batch for c in configs if f"{c.model} {c.recipe}" == key)
        path = artifact(model, recipe, cache)
        a = analyses[key] = analyses.get(key) or analyse_file(path, model, "1")
        out[key] = calibrate(path, a, profile, top, 1, TOKENS, PROMPT, STEP_CONTEXT)
        print(f"calibration {key}: {out[key].as_dict()}", flush=True)
    return out


def servings_for(configs: list[Config], cache: Path, seconds: float) -> dict:
    """Each encoder model x recipe served through a one-worker mesh (planner/serving.py) at
    batch limits 2 and twice its configurations' largest: the planner then predicts every
    checked batch limit (1 and 8) and replica count from points it was not fitted at."""
    out = {}
    for key in dict.fromkeys(f"{c.model} {c.recipe}" for c in configs if c.model != "smollm2"):
        model, recipe = key.split(" ")
        top = max(c.max_batch for c in configs if f"{c.model} {c.recipe}" == key)
        limits = (2, 2 * top)
        out[key] = calibrate_serving(artifact(model, recipe, cache), model, limits, TOKENS, seconds)
        print(f"serving {key}: {out[key].as_dict()}", flush=True)
    return out


def reanalyse(cache: Path) -> None:
    """Predictions again (same profile, calibrations and measurements) after the planner
    changed."""
    path = RESULTS / "planner.json"
    result = json.loads(path.read_text())
    by_label = {c.label: c for c in CONFIGS}
    configs = [by_label[r["config"]] for r in result["configurations"]]
    base = Profile(**result["profile"])
    analyses = {
        f"{c.model} {c.recipe}": analyse_file(artifact(c.model, c.recipe, cache), c.model, "1")
        for c in configs
    }
    calibrations = {  # the stored timings, fitted again
        k: refit(Calibration.from_dict(v), analyses[k], base, TOKENS, STEP_CONTEXT)
        for k, v in result["calibrations"].items()
    }
    result["calibrations"] = {k: v.as_dict() for k, v in calibrations.items()}
    servings = {k: ServingCalibration.from_dict(v) for k, v in result["servings"].items()}
    for c, r in zip(configs, result["configurations"], strict=True):
        key = f"{c.model} {c.recipe}"
        m = r["measured"]
        profile = replace(base, background_cores=m["background_cores"])
        r.update(predictions(c, analyses[key], profile, m, calibrations[key], servings.get(key)))
    result["summary"] = summarize(result["configurations"])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["reanalysed"] = (
        "predictions recomputed on these measurements and timings after the planner changed "
        f"(`python -m benchmarks.planner --reanalyse`, {when})"
    )
    plots(result["configurations"], analyses, base)
    print(f"wrote {write_result('planner', result)}")
    print(result["summary"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--skip-llm", action="store_true")
    parser.add_argument("--cache", type=Path, default=CACHE, help="the quantize cache")
    parser.add_argument(
        "--reanalyse",
        action="store_true",
        help="recompute the predictions from the measurements in results/planner.json",
    )
    args = parser.parse_args()
    if args.reanalyse:
        reanalyse(args.cache)
        return
    configs = [c for c in CONFIGS if not (args.skip_llm and c.model == "smollm2")]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for c in configs:  # build what is missing before anything is measured
            artifact(c.model, c.recipe, args.cache)
        profile = probe.probe(2.0)
        overhead = probe.mesh_overhead(tmp / "probe", 6.0)
        profile = Profile(**{**profile.as_dict(), **overhead})
        profiles.save(profile, profiles.default_probed())
        analyses: dict[str, ModelAnalysis] = {}
        calibrations = calibrations_for(configs, profile, args.cache, analyses)
        servings = servings_for(configs, args.cache, min(args.seconds, 3.0))
        rows = []
        for c in configs:
            rows.append(
                run_config(
                    c, tmp, profile, args.seconds, args.cache, analyses, calibrations, servings
                )
            )
            write_result("planner_partial", {"profile": profile.as_dict(), "rows": rows})
    summary = summarize(rows)
    result = {
        "benchmark": "planner",
        "machine": machine(),
        "machine_note": f"{machine()['cpu']}, {profile.cores} cores, no GPU, shared with "
        "other jobs (their CPU demand measured before each row)",
        "profile": profile.as_dict(),
        "calibrations": {k: v.as_dict() for k, v in calibrations.items()},
        "servings": {k: v.as_dict() for k, v in servings.items()},
        "seconds_per_point": args.seconds,
        "configurations": rows,
        "summary": summary,
    }
    plots(rows, analyses, profile)
    print(f"wrote {write_result('planner', result)}")
    (RESULTS / "planner_partial.json").unlink(missing_ok=True)
    print(summary)


# ---- benchmarks/README.md: this benchmark's section (python -m benchmarks.summary) ----


def section(r: dict) -> str:
    def pct(x: float | None) -> str:
        return "unbounded" if x is None else f"{x:+.0%}"

    def ms(x: float | None) -> str:
        return "unbounded" if x is None else f"{x:.1f}"  # the queue never settles

    rows = []
    for c in r["configurations"]:
        m, roof, cal = c["measured"], c["roofline"], c["calibrated"]
        served = c.get("served", cal)
        rows.append(
            [
                c["config"],
                c["diagnosis"]["bound"],
                round(m["throughput_rps"], 2),
                f"{roof['capacity_rps']:.1f} ({pct(roof['throughput_error'])})",
                f"{cal['capacity_rps']:.1f} ({pct(cal['throughput_error'])})",
                f"{served['capacity_rps']:.1f} ({pct(served['throughput_error'])}, "
                f"{served['limit']})",
                round(m["offered_rps"], 2),
                round(m["p99_ms"], 1),
                f"{ms(roof['p99_ms'])} ({pct(roof['p99_error'])})",
                f"{ms(cal['p99_ms'])} ({pct(cal['p99_error'])})",
                f"{ms(served['p99_ms'])} ({pct(served['p99_error'])})",
                f"{m['closed']['mean_batch']:.1f} / {m['open']['mean_batch']:.1f}",
                m.get("background_cores", 0.0),
                f"{m['closed'].get('other_cores', 0.0):.2f} / "
                f"{m['open'].get('other_cores', 0.0):.2f}",
            ]
        )
    s = r["summary"]

    def verdict(m: dict, label: str) -> str:
        return f"{label}: " + ", ".join(
            f"{k} median |error| {m[f'median_abs_{k}_error']:.0%} (target "
            f"{s['targets'][k]:.0%}: {'met' if m['met'][k] else 'missed'})"
            for k in ("throughput", "p99")
        )

    calibrations = "; ".join(
        f"{k}: {v['runs_ms']} ms by batch, {v['call_overhead_ms']} ms fixed per run, "
        f"efficiency {v['efficiency']}"
        + (f", prefill {v['prefill_ms']} ms" if v["prefill_ms"] else "")
        for k, v in r["calibrations"].items()
    )

    def tail(v: dict) -> str:
        points = v["served"][-1].get("tail") or []
        return (
            ", trip tail "
            + ", ".join(
                f"p99 {p99 * 1e3:.0f} ms at {rate:.0f}/s ({busy:.2f} cores busy)"
                for busy, p99, rate in points
            )
            if points
            else ""
        )

    servings = "; ".join(
        f"{k}: {v['cycles_ms']} ms per batch by batch{tail(v)}"
        for k, v in r.get("servings", {}).items()
    )
    p = r["profile"]
    misses = [
        f"- **{c['config']}**: " + "; ".join(c["explanation"])
        for c in r["configurations"]
        if c["explanation"]
    ]
    return "\n\n".join(
        [
            "## Planner: predicted against measured (issue 14)",
            f"`python -m benchmarks.planner` — {r['machine_note']}. Profile: {p['source']}; "
            f"mesh {p['mesh_latency_s'] * 1e3:.1f} ms (p99 {p['mesh_latency_p99_s'] * 1e3:.1f} "
            f"ms at a quarter of its top rate) and {p['mesh_cpu_s'] * 1e3:.2f} CPU-ms per call, "
            f"at most {p['mesh_max_rps']:.0f} calls/s. Throughput: the saturation throughput of "
            "a closed loop with 4 x replicas x max batch callers (8 to 64); p99: an open loop at "
            "half the measured throughput (offered /s). *Roofline*: predicted from the probe "
            "and the graph alone; *calibrated*: the Roofline fitted to each model's own "
            "session timed alone, outside the mesh (CPU time, one thread, batch 1 and the "
            f"largest): {calibrations}; *served*: fitted to each encoder served through a "
            "one-worker mesh (planner/serving.py; seconds per batch and host CPU per call at "
            "saturation at batch limits 2 and 16, which no checked row uses, and the trip's "
            f"tail under Poisson arrivals at a quarter, half and three quarters of the 16's "
            f"rate): {servings}; the LLM rows' *served* is "
            "the calibrated prediction. Batch: what the workers formed in the closed / open "
            "loop. Background: other jobs' CPU demand (cores) measured just before each row; "
            "other: their cores during the closed / open loop (the host's busy cores less ours)."
            + (f" The {r['reanalysed']}." if r.get("reanalysed") else ""),
            table(
                [
                    "configuration",
                    "bound",
                    "req/s",
                    "roofline",
                    "calibrated",
                    "served",
                    "offered /s",
                    "p99 ms",
                    "roofline",
                    "calibrated",
                    "served",
                    "batch",
                    "background",
                    "other",
                ],
                rows,
            ),
            verdict(s["roofline"], "Roofline only")
            + "; "
            + verdict(s["calibrated"], "calibrated")
            + (("; " + verdict(s["served"], "served")) if "served" in s else "")
            + ".",
            "Misses of the best prediction and why:\n\n" + "\n".join(misses)
            if misses
            else "No misses.",
            "![roofline](results/planner_roofline.png)",
        ]
    )


if __name__ == "__main__":
    main()
