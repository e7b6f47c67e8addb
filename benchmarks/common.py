"""Helpers the benchmark scripts share: machine facts, a closed-loop gRPC load, results."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import onnxruntime

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """`concurrency` callers, each sending the next request when the last one answers."""
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    latencies: list[int] = []
    errors: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    measure_from = loop.time() + warmup
    stop_at = measure_from + seconds
    sent = 0

    async def caller() -> None:
        nonlocal sent
        while loop.time() < stop_at and sent < max_requests:
            sent += 1
            t0 = time.perf_counter_ns()
            try:
                await stub.ModelInfer(request, timeout=30)
            except grpc.aio.AioRpcError as e:
                if loop.time() >= measure_from:
                    errors[e.code().name] += 1
                continue
            if loop.time() >= measure_from:
                latencies.append(time.perf_counter_ns() - t0)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    await channel.close()
    lat = np.array(latencies) / 1e6
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "throughput_rps": round(len(latencies) / seconds, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
        "errors": dict(errors),
    }


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


async def open_loop(
    address: str,
    request: pb.ModelInferRequest,
    rate: float,
    seconds: float,
    warmup: float = 1.0,
    timeout: float = 30.0,
    seed: int = 0,
) -> dict:
    """Poisson arrivals at `rate` per second, each sent whether or not earlier ones returned.

    Latency counts from the arrival's scheduled time, not from when the client got round to
    sending it, so a stalled client cannot hide queueing (no coordinated omission).
    """
    rng = np.random.default_rng(seed)
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    start = loop.time()
    measure_from = start + warmup
    end = measure_from + seconds
    tasks = []

    async def one(scheduled: float) -> None:
        try:
            await stub.ModelInfer(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if scheduled >= measure_from:
                errors[e.code().name] += 1
            return
        if scheduled >= measure_from:
            latencies.append(loop.time() - scheduled)

    t = start
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= end:
            break
        delay = t - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(t)))
    await asyncio.gather(*tasks)
    await channel.close()
    lat = np.array(latencies) * 1000
    return {
        "offered_rps": rate,
        "requests": len(latencies),
        "throughput_rps": round(len(latencies) / seconds, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
        "errors": dict(errors),
    }


def model_successes(address: str, model: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
    return sum(s.inference_stats.success.count for s in reply.model_stats)
