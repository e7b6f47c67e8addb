"""One worker replica as the router sees it: the one gRPC channel the router reuses for it,
the worker's last depth sample, the router's own in-flight calls to it, and its ejection
state. The registry (registry.py) keeps them from Redis; replica_health.py
ejects, probes and re-admits them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from common.mesh_state import DepthSample, WorkerInfo

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


@dataclass(eq=False)
class Replica:
    info: WorkerInfo
    channel: grpc.aio.Channel
    info_json: str = ""  # as read from Redis: unchanged text needs no second parse
    sample: DepthSample | None = None
    inflight: dict[int, int] = field(default_factory=dict)  # call token -> start unix ms
    last_seen: float = field(default_factory=time.monotonic)
    ejected_until: float = 0.0
    backoff_s: float = 0.0
    checking: bool = False
    dropped: bool = False  # left the registry
    calls: set = field(default_factory=set)  # grpc.aio calls in flight to it
    abandoned: set = field(default_factory=set)  # of those, the ones the registry cancelled
    probed_at: float = 0.0  # last health probe of a replica that looked stalled
    heard_at: float = 0.0  # last response from it on a call (monotonic)

    def __post_init__(self) -> None:
        # Bytes in, bytes out: the request is forwarded as it came.
        self.infer = self.channel.unary_unary(INFER_METHOD)
        self.stream = self.channel.stream_stream(STREAM_METHOD)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def ejected(self) -> bool:
        return time.monotonic() < self.ejected_until

    def abandon(self) -> None:
        """Cancel the calls in flight to a replica that stopped answering: the dispatcher
        sees them as UNAVAILABLE and retries them elsewhere."""
        for call in list(self.calls):
            self.abandoned.add(call)
            call.cancel()
