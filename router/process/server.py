"""The router process: registry, dispatcher and accounting behind one gRPC endpoint.

`serve` reads down as its steps: refuse an open --no-auth, build the parts (`build`), start
them, serve gRPC (and HTTP), wait for a signal, drain."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import start_http_server

from common import redis_conn, rpc, tls
from common.redis_auth import read_password
from router.forwarding.dispatch import Dispatcher
from router.forwarding.registry import Registry
from router.forwarding.shedding import Shedder
from router.http import HttpServer, front_door
from router.http.model_names import parse_aliases
from router.mesh import MeshApi
from router.money.accounting import Accounting
from router.process.settings import RouterSettings
from router.servicer import RouterServicer, handler
from router.tenancy.auth import Auth
from router.tenancy.limits import Limiter

log = structlog.get_logger()


@dataclass
class Parts:
    """The router's parts, built from its settings before anything serves."""

    registry: Registry
    accounting: Accounting
    auth: Auth | None
    dispatcher: Dispatcher
    mesh_credentials: grpc.ChannelCredentials | None  # mutual TLS to the workers


def refuse_open_no_auth(settings: RouterSettings, http_host: str) -> None:
    """--no-auth serves 127.0.0.1 only (make run)."""
    if not settings.auth and settings.http_port and not rpc.is_loopback(http_host):
        raise ValueError(
            f"--no-auth is for make run on 127.0.0.1 only; refusing to serve HTTP on "
            f"{http_host} without API keys"
        )
    if not settings.auth and not rpc.is_loopback(settings.host):
        raise ValueError(
            f"--no-auth is for make run on 127.0.0.1 only; refusing to serve {settings.host} "
            "without API keys"
        )


def build_auth(settings: RouterSettings, password: str | None) -> Auth | None:
    """API keys and per-tenant limits from Redis; None (loudly) with --no-auth."""
    if settings.auth:
        redis = redis_conn.connect_async(
            settings.redis_url, password=password, timeout_s=0.5, connect_timeout_s=0.5
        )
        return Auth(redis, Limiter(redis), settings.auth_cache_seconds)
    log.warning(
        "AUTH_OFF_ANYONE_WHO_REACHES_THIS_PORT_IS_TRUSTED",
        address=f"{settings.host}:{settings.port}",
        note="API keys, per-tenant limits and tenant billing are off (make run only)",
    )
    return None


def build(settings: RouterSettings, router_id: str) -> Parts:
    password = read_password(settings.redis_password, settings.redis_password_file)
    mesh_credentials = (
        tls.channel_credentials(settings.mesh_ca, settings.mesh_cert, settings.mesh_key)
        if settings.mesh_ca
        else None
    )
    registry = Registry(
        settings.redis_url,
        rpc.message_options(settings.max_message_bytes),
        password=password,
        channel_credentials=mesh_credentials,
        poll_s=settings.poll_seconds,
        ttl_s=settings.registry_ttl_seconds,
        eject_base_s=settings.eject_base_seconds,
        eject_max_s=settings.eject_max_seconds,
        stall_s=settings.stall_seconds,
    )
    accounting = Accounting(
        settings.redis_url,
        router_id,
        settings.accounting_wait_seconds,
        settings.accounting_when_slow,
        inflight=lambda: sum(len(r.inflight) for r in registry.replicas.values()),
        password=password,
        commit=settings.accounting_commit,
        max_unwritten=settings.accounting_max_unwritten,
    )
    auth = build_auth(settings, password)
    if auth is not None:
        accounting.charge = auth.charge
    dispatcher = Dispatcher(
        registry,
        accounting if settings.accounting else None,
        policy_name=settings.policy,
        sample_max_age_ms=settings.sample_max_age_ms,
        default_timeout_s=settings.default_timeout_seconds,
        max_inflight=settings.max_inflight,
        max_inflight_per_model=settings.max_inflight_per_model,
        answer_margin_s=settings.answer_margin_ms / 1000,
        max_sessions=settings.max_sessions,
        auth=auth,
        prefix_weight=settings.prefix_weight,
        prefix_index_blocks=settings.prefix_index_blocks,
        shedder=(
            Shedder(settings.queue_wait_bound_seconds, settings.sample_max_age_ms)
            if settings.queue_wait_bound_seconds > 0
            else None
        ),
        migration_limit=settings.migration_limit,
    )
    return Parts(registry, accounting, auth, dispatcher, mesh_credentials)


def server_credentials(settings: RouterSettings) -> grpc.ServerCredentials | None:
    if settings.tls_cert and settings.tls_key:
        return tls.server_credentials(settings.tls_cert, settings.tls_key)
    return None


def http_server(settings: RouterSettings, http_host: str, mesh: MeshApi) -> HttpServer:
    return HttpServer(
        front_door(
            mesh,
            settings.http_max_body_bytes,
            settings.http_body_timeout_seconds,
            parse_aliases(settings.http_model_aliases),
        ),
        http_host,
        settings.http_port,
        reuse_port=settings.shared_port,
        tls_cert=settings.tls_cert if settings.tls_key else None,
        tls_key=settings.tls_key if settings.tls_cert else None,
        header_timeout_s=settings.http_header_timeout_seconds,
    )


async def serve(settings: RouterSettings, on_ready: Callable[[], None] | None = None) -> None:
    router_id = settings.router_id or f"router-{settings.host}-{settings.port}-{os.getpid()}"
    http_host = settings.http_host or settings.host
    refuse_open_no_auth(settings, http_host)
    parts = build(settings, router_id)
    registry, auth = parts.registry, parts.auth
    await registry.start()
    parts.accounting.start()
    if auth is not None:
        auth.limiter.start()

    reflection = rpc.reflection_wanted(settings.host, settings.reflection)
    # SO_REUSEPORT only for this router's own processes (see router.process.processes): a router
    # started alone on a taken port fails, as before.
    server, health = rpc.new_server(
        settings.max_message_bytes, reflection, reuse_port=settings.shared_port
    )
    mesh = MeshApi(registry, parts.dispatcher, auth)  # what both front doors call
    server.add_generic_rpc_handlers((handler(RouterServicer(mesh)),))
    credentials = server_credentials(settings)
    port = tls.add_port(server, f"{settings.host}:{settings.port}", credentials)
    await server.start()
    http = http_server(settings, http_host, mesh) if settings.http_port else None
    if http is not None:
        await http.start()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.metrics_host)
    await rpc.set_serving(health)
    if on_ready is not None:
        on_ready()
    log.info(
        "router_ready",
        router=router_id,
        address=f"{settings.host}:{port}",
        http=f"{http_host}:{settings.http_port}" if http else None,
        policy=settings.policy,
        auth=settings.auth,
        tls=credentials is not None,
        mesh_tls=parts.mesh_credentials is not None,
        reflection=reflection,
        replicas=sorted(registry.replicas),
        metrics=f"{settings.metrics_host}:{settings.metrics_port}"
        if settings.metrics_port
        else None,
    )

    await rpc.stop_on_signals().wait()

    log.info("router_draining")
    await health.enter_graceful_shutdown()
    if http is not None:
        await http.stop(settings.grace_seconds)
    await server.stop(settings.grace_seconds)
    await parts.accounting.close()  # last flush of the usage totals
    if auth is not None:
        await auth.limiter.close()
        await auth.redis.aclose()
    await registry.close()
    log.info("router_stopped", router=router_id)
