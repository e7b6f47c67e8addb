"""Helpers the benchmark scripts share: machine facts, processes, the load tool's loops,
results."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime

from common.net import free_port as free_port  # re-exported
from devmesh import processes
from loadtest import runner as loadtest_runner
from loadtest.runner import Load, measured
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "platform": platform.platform(),
    }


def wait_ready(address: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.ServerReady(pb.ServerReadyRequest(), timeout=1).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not ready after {timeout}s")


def spawn(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


@contextlib.contextmanager
def standalone_worker(repository: Path, log_dir: Path, *extra: str) -> Iterator[str]:
    """One worker process (no Redis) on a free port: its address while the block runs."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    worker = processes.worker_process(repository, port, log_dir, None, *extra).start()
    try:
        processes.wait_serving(address, worker)
        yield address
    finally:
        worker.stop(30)


def infer_request(model: str, name: str, array: np.ndarray, datatype: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=array.shape)
    request.raw_input_contents.append(array.tobytes())
    return request


async def closed_loop(
    address: str,
    request: pb.ModelInferRequest,
    concurrency: int,
    seconds: float,
    warmup: float = 1.0,
    max_requests: int = 1_000_000,
) -> dict:
    """`concurrency` callers, each sending the next request when the last one answers
    (the load tool's closed loop; HDR percentiles, errors by status code)."""
    load = Load(address, [request.SerializeToString()], seconds, warmup, 30.0, max_requests)
    return measured(await loadtest_runner.closed_loop(load, concurrency))


def write_result(name: str, payload: dict) -> Path:
    """results/<name>.json; a number that is not finite (no measurement) is written as null,
    which every JSON parser reads (Infinity and NaN are not JSON)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n")
    return path


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


async def open_loop(
    address: str,
    request: pb.ModelInferRequest,
    rate: float,
    seconds: float,
    warmup: float = 1.0,
    timeout: float = 30.0,
    seed: int = 0,
) -> dict:
    """Poisson arrivals at `rate` per second, latency from each arrival's scheduled time
    (the load tool's open loop: no coordinated omission)."""
    load = Load(address, [request.SerializeToString()], seconds, warmup, timeout)
    return measured(await loadtest_runner.open_loop(load, rate, seed=seed))


def model_successes(address: str, model: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
    return sum(s.inference_stats.success.count for s in reply.model_stats)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, as /proc shows them now."""
    pids, i = [pid], 0
    while i < len(pids):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pids[i]}/task").iterdir():
                pids += [int(p) for p in (task / "children").read_text().split()]
        i += 1
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (those still running)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks
