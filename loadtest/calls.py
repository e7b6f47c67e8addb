"""The load tool's two loops over one request message, each in one call: what a benchmark
or the planner's validation measures a mesh with (`runner` does the driving, `stats` the
counting; this only builds the Load and drops the CDF points).
"""

from __future__ import annotations

from loadtest import runner
from loadtest.runner import Load, measured
from protos import grpc_service_pb2 as pb


async def closed_loop(
    address: str,
    request: pb.ModelInferRequest,
    concurrency: int,
    seconds: float,
    warmup: float = 1.0,
    max_requests: int = 1_000_000,
) -> dict:
    """`concurrency` callers, each sending the next request when the last one answers
    (HDR percentiles, errors by status code)."""
    load = Load(address, [request.SerializeToString()], seconds, warmup, 30.0, max_requests)
    return measured(await runner.closed_loop(load, concurrency))


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
    (no coordinated omission)."""
    load = Load(address, [request.SerializeToString()], seconds, warmup, timeout)
    return measured(await runner.open_loop(load, rate, seed=seed))
