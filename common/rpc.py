"""gRPC set-up the servers (worker, router) and the clients share."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

SERVICE = "inference.GRPCInferenceService"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
Health = HealthServicer  # the health service a server sets SERVING / NOT_SERVING on
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def message_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Explicit message size limits, for a channel or a server."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def new_server(
    max_message_bytes: int, reflection_on: bool = True, reuse_port: bool = False
) -> tuple[grpc.aio.Server, HealthServicer]:
    """A grpc.aio server with health checking (and reflection, unless asked not to); add
    the inference service.

    Without `reuse_port` a taken port is an error, not a silent second listener; with it
    (SO_REUSEPORT), several processes that all ask for it share the port and the kernel
    spreads their connections (the router's `--processes`)."""
    server = grpc.aio.server(
        options=[*message_options(max_message_bytes), ("grpc.so_reuseport", int(reuse_port))]
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if reflection_on:
        reflection.enable_server_reflection([SERVICE, _HEALTH, reflection.SERVICE_NAME], server)
    return server, health


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", "[::1]") or host.startswith("127.")


def reflection_wanted(host: str, asked: bool | None) -> bool:
    """Server reflection lists every service and message: on when asked, else only on a
    server bound to loopback."""
    return is_loopback(host) if asked is None else asked


async def set_serving(health: HealthServicer) -> None:
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, for the server's drain."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def inference_handler(
    servicer: Any, infer: grpc.RpcMethodHandler, stream: grpc.RpcMethodHandler
) -> grpc.GenericRpcHandler:
    """inference.GRPCInferenceService over `servicer`, with ModelInfer and ModelStreamInfer as
    the server registers them (the router: bytes in and out; the worker: a parser that never
    raises); every other method (de)serializes its own messages."""
    from protos import grpc_service_pb2 as pb

    def unary(name: str) -> grpc.RpcMethodHandler:
        request, response = getattr(pb, f"{name}Request"), getattr(pb, f"{name}Response")
        return grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )

    plain = (
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
    )
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {"ModelInfer": infer, "ModelStreamInfer": stream, **{n: unary(n) for n in plain}},
    )
