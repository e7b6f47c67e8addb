"""A real mesh for tests and fault scripts: private redis-server, workers, a router."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from devmesh import toy_models
from devmesh.processes import LocalMesh
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

T = TypeVar("T")


def mlp_repository(root: Path, config: str) -> Path:
    toy_models.write(root / "mlp", toy_models.mlp(), config)
    return root


def mlp_config(
    simulated_us: int = 0, max_batch: int = 8, queue: int = 128, delay_us: int = 0
) -> str:
    return (
        f"max_batch_size: {max_batch}\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} "
        f"default_queue_policy {{ max_queue_size: {queue} }} }}\n"
        'parameters { key: "meshserve.price_per_call_micro_usd" value { string_value: "250" } }\n'
        'parameters { key: "meshserve.simulated_compute_us" '
        f'value {{ string_value: "{simulated_us}" }} }}\n'
    )


class Mesh(LocalMesh):
    """The mesh as tests start it: CPU, one onnxruntime thread, fast heartbeats."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(
            log_dir,
            worker_args=(
                "--providers",
                "cpu",
                "--intra-op-threads",
                "1",
                "--heartbeat-seconds",
                "0.2",
            ),
        )

    def stop(self, kill: bool = True) -> None:
        super().stop(kill=kill)


def worker_successes(address: str, model: str = "mlp") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=5)
    return sum(s.inference_stats.success.count for s in reply.model_stats)


def mlp_request(i: int = 0) -> pb.ModelInferRequest:
    x = np.full((1, 16), i % 7, np.float32)
    request = pb.ModelInferRequest(model_name="mlp", id=str(i))
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(x.tobytes())
    return request


async def call_many(
    address: str,
    n: int,
    concurrency: int,
    max_seconds: float = 60.0,
    timeout: float = 10.0,
    key: str | None = None,
) -> Counter[str]:
    """n ModelInfer calls, `concurrency` at a time (with the API key `key`, if given); status
    code name -> count. Bounded in count and in time (calls not started by max_seconds are
    not made)."""
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    codes: Counter[str] = Counter()
    next_i = 0
    stop_at = time.monotonic() + max_seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def caller() -> None:
            nonlocal next_i
            while next_i < n and time.monotonic() < stop_at:
                i = next_i
                next_i += 1
                try:
                    await stub.ModelInfer(mlp_request(i), timeout=timeout, metadata=metadata)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return codes


def model_usage(store: Any, model: str, *fields: str) -> tuple[int, ...]:
    """The ledger's totals of `fields` for `model` (every version): `store` is a
    ledger.store.Store."""
    usage = [v for (m, _), v in store.usage().items() if m == model]
    return tuple(sum(v[f] for v in usage) for f in fields)


def settle(read: Callable[[], T], expected: T, timeout: float = 30.0, quiet: float = 1.0) -> T:
    """What `read` gives once it equals `expected` (or at `timeout`), read again `quiet`
    seconds later: nothing more may arrive (a late refund or over-count would show)."""
    deadline = time.monotonic() + timeout
    while read() != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(quiet)
    return read()
