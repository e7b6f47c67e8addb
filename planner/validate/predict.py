"""The three predictions of one checked configuration (the bare Roofline, fitted to the
session alone, fitted to a one-worker mesh: "served", the one judged), their errors against
the measurement, the medians over every row, and why the best prediction missed, from the
numbers."""

from __future__ import annotations

import statistics

from perfmodel.analysis import ModelAnalysis
from perfmodel.profiles import Profile
from perfmodel.queueing import Prediction, between, predict
from perfmodel.roofline import run_seconds
from planner.calibrate import Calibration
from planner.plan import Workload, service_time
from planner.serving import ServingCalibration, served_profile
from planner.validate.configs import BEST, MAX_TOKENS, PROMPT, STEP_CONTEXT, TARGETS, TOKENS, Config


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
    llm_call = c.llm
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
    why = explain(c, out[BEST], m, used) if missed(out[BEST]) else []
    return {**out, "explanation": why}


def compare(
    c: Config,
    a: ModelAnalysis,
    profile: Profile,
    m: dict,
    prefill_s: float | None,
    served: bool = False,
) -> dict:
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


def explain(c: Config, pred: dict, meas: dict, profile: Profile) -> list[str]:
    """Why the best prediction missed, from the numbers: the batches, the replicas' seconds
    per batch, the host's CPU per call, the cores the open loop kept busy, or the mesh
    around them. `profile`: the one the prediction was made with."""
    why = []
    closed, opened = meas["closed"], meas["open"]
    llm = c.llm
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
