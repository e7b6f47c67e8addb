"""The router process: registry, dispatcher and accounting behind one gRPC endpoint."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from router.accounting import Accounting
from router.dispatch import Dispatcher
from router.registry import Registry
from router.servicer import SERVICE, RouterServicer, handler
from router.settings import RouterSettings

log = structlog.get_logger()


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


async def serve(settings: RouterSettings) -> None:
    router_id = settings.router_id or f"router-{settings.host}-{settings.port}-{os.getpid()}"
    registry = Registry(
        settings.redis_url,
        channel_options(settings.max_message_bytes),
        poll_s=settings.poll_seconds,
        ttl_s=settings.registry_ttl_seconds,
        eject_base_s=settings.eject_base_seconds,
        eject_max_s=settings.eject_max_seconds,
    )
    accounting = Accounting(
        settings.redis_url,
        router_id,
        settings.accounting_wait_seconds,
        inflight=lambda: sum(len(r.inflight) for r in registry.replicas.values()),
    )
    dispatcher = Dispatcher(
        registry,
        accounting if settings.accounting else None,
        policy_name=settings.policy,
        sample_max_age_ms=settings.sample_max_age_ms,
        default_timeout_s=settings.default_timeout_seconds,
    )
    await registry.start()
    accounting.start()

    server = grpc.aio.server(
        options=[*channel_options(settings.max_message_bytes), ("grpc.so_reuseport", 0)]
    )
    server.add_generic_rpc_handlers((handler(RouterServicer(registry, dispatcher)),))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.metrics_host)
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "router_ready",
        router=router_id,
        address=f"{settings.host}:{port}",
        policy=settings.policy,
        replicas=sorted(registry.replicas),
        metrics=f"{settings.metrics_host}:{settings.metrics_port}"
        if settings.metrics_port
        else None,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("router_draining")
    await health.enter_graceful_shutdown()
    await server.stop(settings.grace_seconds)
    await accounting.close()  # last flush of the usage totals
    await registry.close()
    log.info("router_stopped", router=router_id)
