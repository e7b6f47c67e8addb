"""A calibration in the serving path: the model served by a one-worker mesh (a private
Redis, one worker, the router), the load tool's client on this host, as the mesh will run it.

A bare onnxruntime session (planner/calibrate.py) times the arithmetic. The serving path
adds what the arithmetic does not show, and on a small shared host it is most of the cost:
gRPC and the codec on the worker's and the router's event loops, the batcher, the run's
thread waiting for the interpreter lock after onnxruntime returns, the router relaying the
model's answer (24.6 KB for a MiniLM item), the client's own CPU, and each process's runs
stretched by the others on the same cores. A worker timed alone, without the router beside
it, ran MiniLM int8 at batch 1 in 1.0-1.7 ms where the mesh's worker took 2.0 ms, and cost
1.7 ms of host CPU per call where the mesh cost 4.1 ms (benchmarks/results/planner.json
before this change): the router is the third busy process on two cores. So each batch limit
L is served through the router: a closed loop with enough callers to keep L calls queued (2 L,
at least 4) saturates the replica, and four figures come back from the worker's own
statistics and /proc: the batch it formed, the wall time of its runs, calls/s and the host
CPU seconds per call (client, router, Redis and worker).

The queueing model's S(b) is then the seconds per batch at saturation, b / (calls/s): the
run and the worker's own work between runs (answering the last batch, forming the next on
its event loop), for which the replica is as good as busy. Host CPU per call falls with the
batch as f + g / b (the run's share spread over the batch), through both points.

At the largest limit, three open loops (Poisson arrivals at TAIL_SHARES of its saturated
rate) measure the trip's tail with the model's own call: the p99 less what the queueing
model gives the replica itself there (its run and its queue, perfmodel/queueing.py, so that
neither is counted twice), against the host's busy cores over the window (ours and other
jobs', from /proc/stat). On two shared cores that wait for a core is most of a p99
(planner/probe.py measures the same with a 16-byte call, whose CPU and answer are not the
model's). Only the calibrated limits are seen here: what other replica counts, batch limits
and loads do is the planner's prediction.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np

from common import paths
from devmesh.processes import LocalMesh
from loadtest.runner import Load, closed_loop, open_loop
from perfmodel.analysis import ModelAnalysis
from perfmodel.profiles import Profile
from perfmodel.queueing import predict
from perfmodel.roofline import run_seconds
from planner.calibrate import Calibration, encoder_feeds, refit
from planner.probe import busy_cores, cpu_seconds, host_cpu
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

WORKER_ARGS = ("--providers", "cpu", "--intra-op-threads", "1")


@dataclass(frozen=True)
class Served:
    """One batch limit's saturated run through a one-worker mesh."""

    max_batch: int
    batch: float  # the mean batch the worker formed
    run_s: float  # mean wall time of a run
    rps: float
    cpu_per_call_s: float  # client, router, Redis and worker
    # Under Poisson arrivals at shares of `rps`: [cores busy (ours and other jobs'), the
    # p99 of a call, calls/s], the trip's tail with the model's own payload
    tail: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class ServingCalibration:
    served: list[Served]

    def cycles_s(self) -> dict[int, float]:
        """Seconds per batch at saturation, b / (calls/s), by (rounded) batch: the run and
        the worker's own work between runs, the replica's service time S(b) as the queueing
        model counts it; the points the Roofline fit passes through."""
        return {max(1, round(s.batch)): s.batch / s.rps for s in self.served}

    def cpu_per_call_s(self, batch: float) -> float:
        """Host CPU per call (the whole mesh and its client) at `batch`: f + g / b through
        both points."""
        lo, hi = self.served[0], self.served[-1]
        if hi.batch <= lo.batch:
            return lo.cpu_per_call_s
        g = (lo.cpu_per_call_s - hi.cpu_per_call_s) / (1 / lo.batch - 1 / hi.batch)
        return max(0.0, hi.cpu_per_call_s - g / hi.batch + g / max(batch, 1.0))

    def as_dict(self) -> dict:
        return {
            "served": [
                {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(s).items()}
                for s in self.served
            ],
            "cycles_ms": {str(b): round(v * 1e3, 3) for b, v in self.cycles_s().items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> ServingCalibration:
        return cls([Served(**s) for s in d["served"]])


def encoder_request(path: Path, model: str, tokens: int) -> pb.ModelInferRequest:
    """One item, as a client sends it."""
    request = pb.ModelInferRequest(model_name=model)
    for name, value in encoder_feeds(path, 1, tokens).items():
        datatype = "INT64" if value.dtype == np.int64 else "FP32"
        request.inputs.add(name=name, datatype=datatype, shape=list(value.shape))
        request.raw_input_contents.append(np.ascontiguousarray(value).tobytes())
    return request


def model_statistics(address: str, model: str) -> pb.ModelStatisticsResponse:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=30)


def batch_totals(reply: pb.ModelStatisticsResponse) -> tuple[int, int, int]:
    """(runs, rows, compute ns) so far, summed over a ModelStatistics reply's batch sizes."""
    runs = rows = ns = 0
    for s in reply.model_stats:
        for b in s.batch_stats:
            runs += b.compute_infer.count
            rows += b.batch_size * b.compute_infer.count
            ns += b.compute_infer.ns
    return runs, rows, ns


def repository(path: Path, model: str, max_batch: int, root: Path) -> Path:
    """A one-model repository serving `path` at batch limit `max_batch`."""
    folder = root / model
    (folder / "1").mkdir(parents=True)
    paths.link_or_copy(path, folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        f'name: "{model}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch}\n'
        "dynamic_batching { }\n"
    )
    return root


def serve_once(
    path: Path,
    model: str,
    max_batch: int,
    tokens: int,
    seconds: float,
    workdir: Path,
    tail_shares: Sequence[float] = (),
) -> Served:
    repo = repository(path, model, max_batch, workdir / f"b{max_batch}" / "repo")
    mesh = LocalMesh(workdir / f"b{max_batch}" / "logs", worker_args=WORKER_ARGS)
    mesh.start_redis()
    try:
        worker = mesh.add_worker(repo)
        mesh.wait_registered(1, timeout=120)
        router = mesh.start_router()
        ours = [*mesh.workers.values(), mesh.router, mesh.redis_server]
        pids = [p.popen.pid for p in ours if p is not None and p.popen is not None]
        body = encoder_request(path, model, tokens).SerializeToString()
        callers = max(4, 2 * max_batch)
        # the warm-up second runs too: statistics and CPU are read around the measured window
        asyncio.run(closed_loop(Load(router, [body], 1.0, 0.0, 30.0), callers))
        runs0, rows0, ns0 = batch_totals(model_statistics(worker, model))
        cpu0 = cpu_seconds(pids)
        result = asyncio.run(closed_loop(Load(router, [body], seconds, 0.0, 30.0), callers))
        cpu1 = cpu_seconds(pids)
        runs1, rows1, ns1 = batch_totals(model_statistics(worker, model))
        tail = []
        for share in tail_shares:
            rate = share * result["throughput_rps"]
            before = host_cpu()
            # twice the window: a p99 wants a few hundred calls even at the lowest rate
            load = Load(router, [body], 2 * seconds, 0.0, 30.0)
            opened = asyncio.run(open_loop(load, rate))
            busy = busy_cores(before, host_cpu())  # ours and other jobs'
            tail.append([round(busy, 3), opened["p99_ms"] / 1e3, round(rate, 2)])
    finally:
        mesh.stop()
    runs, rows = runs1 - runs0, rows1 - rows0
    if not runs or not rows:
        raise RuntimeError(f"{model} at max batch {max_batch}: no run in {seconds} s: {result}")
    return Served(
        max_batch=max_batch,
        batch=rows / runs,
        run_s=(ns1 - ns0) / runs / 1e9,
        rps=result["throughput_rps"],
        cpu_per_call_s=(cpu1 - cpu0) / rows,
        tail=tail,
    )


TAIL_SHARES = (0.25, 0.5, 0.75)  # of the largest limit's saturated calls/s


def calibrate_serving(
    path: Path, model: str, limits: Sequence[int], tokens: int = 16, seconds: float = 3.0
) -> ServingCalibration:
    """The model served through a one-worker mesh at each batch limit in `limits` (the
    smallest and the largest are the points the fits pass through), and at the largest the
    trip's tail under Poisson arrivals at TAIL_SHARES of its saturated rate."""
    top = max(limits)
    with tempfile.TemporaryDirectory() as tmp:
        return ServingCalibration(
            [
                serve_once(
                    path, model, b, tokens, seconds, Path(tmp), TAIL_SHARES if b == top else ()
                )
                for b in sorted(set(limits))
            ]
        )


def served_profile(
    base: Profile, serving: ServingCalibration, a: ModelAnalysis, max_batch: int, tokens: int
) -> Profile:
    """`base` fitted to the model as the one-worker mesh served it: S(b) through its
    seconds per batch at saturation (the Roofline's fixed cost per run and reachable
    fraction, fitted by planner/calibrate.refit), the mesh's CPU per call beside the run at
    this batch limit, and under Poisson arrivals the trip's tail and the busy cores (a fixed
    part and CPU per call) the calibration's open loops measured with the model's call.
    Without open loops, the probe's tail and open-loop CPU, its CPU per call scaled by the
    ratio of the model's CPU per call beside its run, at batch 1, to the probe's tiny
    call's."""
    # A served cycle can grow faster than the Roofline's bytes and FLOPs (a tiny model,
    # whose weights are its bytes at every batch: the serving work per row is the growth);
    # a negative fixed cost would put S(b) below zero at smaller batches or more threads.
    cal = Calibration(serving.cycles_s(), 0.0, 0.0, 1.0, 1)
    profile = refit(cal, a, base, tokens, negative_overhead=False).profile(base)

    def service(b: int) -> float:
        return run_seconds(a, profile, b, 0, 1, 1, tokens)

    def beside_run(b: int) -> float:
        return max(0.0, serving.cpu_per_call_s(b) - service(b) / b)

    top = serving.served[-1]
    if len(top.tail) >= 2:
        # a fixed part and a part per call (least squares, both >= 0), the runs' share
        # (batches of about 1 at these rates) taken out as the queueing model adds it back
        fixed, per_call = _nonnegative_line([(rate, busy) for busy, _, rate in top.tail])
        open_cpu = (fixed, max(0.0, per_call - service(1)))
    else:
        scale = beside_run(1) / base.mesh_cpu_s if base.mesh_cpu_s else 1.0
        open_cpu = (base.mesh_open_cores, base.mesh_open_cpu_s * scale)
    return replace(
        profile,
        name=f"{base.name}, fitted to {a.name} v{a.version} ({a.recipe}) as served",
        source=f"{base.source}; {a.name} v{a.version} served through a one-worker "
        f"mesh (planner/serving.py): {serving.as_dict()}",
        mesh_cpu_s=beside_run(max_batch),
        mesh_tail=trip_tail(top, service) or base.mesh_tail,
        mesh_open_cores=open_cpu[0],
        mesh_open_cpu_s=open_cpu[1],
    )


def trip_tail(top: Served, service: Callable[[int], float]) -> list[list[float]]:
    """[busy cores, trip p99] from the calibration's open loops: each measured p99 less the
    queueing model's own p99 for the replica there (its run and its wait, with no trip), so a
    prediction at that very point gives the measured p99 back."""
    out = []
    for busy, p99, rate in top.tail:
        own = predict(rate, 1, top.max_batch, service, contended=True).p99_s
        out.append([busy, max(0.0, p99 - own) if math.isfinite(own) else 0.0])
    return out


def _nonnegative_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, k) minimising sum (a + k x - y)^2 over `points` with a, k >= 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    k = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    if k <= 0:
        return max(my, 0.0), 0.0
    if my - k * mx >= 0:
        return my - k * mx, k
    return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
