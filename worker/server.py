"""The worker process: load the repository, serve gRPC, drain on SIGTERM.

torch is imported only for a shard group (`--tp N`, worker/tp/serve.py): a plain worker
runs without it (the `worker` extra does not install it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import gc
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import grpc
import structlog

from common import rpc, tls
from common.mesh_state import ModelEntry, WorkerInfo, now_ms
from common.model_keys import PRICE_PER_1K_CACHED_INPUT as PRICE_CACHED
from common.redis_auth import read_password
from worker import metrics
from worker.codec import Limits
from worker.config import (
    PRICE_PER_1K_INPUT,
    PRICE_PER_1K_OUTPUT,
    PRICE_PER_CALL,
    TRAINING_COST,
    ConfigError,
)
from worker.registration import Registration
from worker.repository import Repository
from worker.roofline import Roofs
from worker.runtime import RuntimeOptions
from worker.scaling import ModelLoad, model_loads
from worker.servicer import WorkerServicer, handler
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from worker.tp.serve import TpRepository

log = structlog.get_logger()


FAILED_EXIT_S = 5.0  # after a group failure the process is gone within this, whatever waits
DEREGISTER_S = 2.0  # leaving the registry tries this long to reach Redis, then drains regardless
# A drain that outlives its stages (leave, wait, grace) by this much is stuck somewhere: every
# thread's stack goes to the log and the process exits 1, so a supervisor never has to kill -9
# a worker that hangs in silence.
DRAIN_SLACK_S = 5.0


class BindFailed(Exception):
    """The gRPC port could not be bound (taken, or not an address of this host)."""


class GroupFailed(Exception):
    """A rank died or a collective timed out; the worker exits so the group restarts."""


def _exit_failed() -> None:
    """The last resort of a failed group: something still waited on it (a thread in a
    collective with the dead rank, a call being cut) past FAILED_EXIT_S."""
    print("meshserve worker: tensor-parallel group failed; exiting", file=sys.stderr, flush=True)
    os._exit(3)


def _return_free_heap() -> None:
    """Give the heap that loading freed back to the OS (glibc's malloc_trim). Parsing a
    model leaves its buffers freed but held by malloc, between live allocations that keep
    the heap from shrinking on its own: 63 MB of SmolLM2 int8's load, resident for the
    process's life. A C library without malloc_trim (musl) keeps it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


async def serve(settings: WorkerSettings) -> None:
    """Bind, load, serve, register; then on SIGTERM drain, or on a group failure stop at
    once. The port is bound before the models load: a shard group's ranks open sockets on
    ephemeral ports while loading (gloo), and one of them could otherwise take the port the
    worker was told to serve on. Nothing answers on it until every model is loaded."""
    bound = bind_grpc(settings)
    repository, group = load_repository(settings)
    grpc_server = await start_grpc(bound, settings, repository)
    servicer = grpc_server.servicer
    metrics_address = None
    if settings.metrics_port:
        metrics_port = metrics.serve(
            repository, settings.metrics_port, settings.metrics_host, servicer.roofline
        )
        metrics_address = f"{settings.metrics_host}:{metrics_port}"

    # What loading made (modules, sessions, tokenizers) lives as long as the process: once
    # its garbage is collected, it is frozen out of the collector's sight, so a full
    # collection scans only what serving allocates (one took 70 ms mid-stream under 16 LLM
    # streams before)
    gc.collect()
    gc.freeze()
    _return_free_heap()
    servicer.ready = True
    await rpc.set_serving(grpc_server.health)
    log.info(
        "worker_ready",
        address=f"{settings.host}:{grpc_server.port}",
        metrics=metrics_address,
        models={m.spec.name: m.spec.version for m in repository.all()},
        providers=sorted(repository.providers),
        tls="mutual" if settings.tls_client_ca else grpc_server.tls,
    )
    registration = register(settings, repository, grpc_server)

    stop = rpc.stop_on_signals()
    failure: list[str] = []
    if group is not None:  # a broken shard group stops the worker at once
        loop = asyncio.get_running_loop()

        def group_failed(why: str) -> None:  # called on the group's watcher thread
            failure.append(why)
            loop.call_soon_threadsafe(stop.set)

        group.start(group_failed)
    await stop.wait()
    faulthandler.dump_traceback_later(drain_budget(settings), exit=True)
    if failure:
        await stop_failed(failure[0], grpc_server, registration, group)
    await drain(settings, repository, grpc_server, registration)


def load_repository(settings: WorkerSettings) -> tuple[Repository, TpRepository | None]:
    """The models, loaded: a plain repository, or a shard group's (which is one too)."""
    options = RuntimeOptions(
        providers=settings.providers,
        require_gpu=settings.require_gpu,
        intra_op_threads=settings.intra_op_threads,
        inter_op_threads=settings.inter_op_threads,
    )
    repository: Repository
    group: TpRepository | None = None
    if settings.tp:
        from worker.tp.serve import TpRepository  # torch: only a shard group needs it

        repository = group = TpRepository(settings, options)
    else:
        repository = Repository(
            settings.model_repository,
            options,
            default_max_batch_size=settings.default_max_batch_size,
            default_max_queue_size=settings.default_max_queue_size,
        )
    repository.load()
    return repository, group


@dataclass
class BoundServer:
    """A gRPC server with health and reflection, its port bound; nothing served yet."""

    server: grpc.aio.Server
    health: rpc.Health
    port: int
    tls: bool


@dataclass
class GrpcServer(BoundServer):
    """The bound server, started with the inference service."""

    servicer: WorkerServicer


def bind_grpc(settings: WorkerSettings) -> BoundServer:
    """The gRPC server, its port bound (refused if taken)."""
    server, health = rpc.new_server(
        settings.max_message_bytes, rpc.reflection_wanted(settings.host, settings.reflection)
    )
    credentials = (
        tls.server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        if settings.tls_cert and settings.tls_key
        else None
    )
    if settings.tls_client_ca and credentials is None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS)")
    address = f"{settings.host}:{settings.port}"
    try:
        port = tls.add_port(server, address, credentials)
    except RuntimeError as e:  # grpc: "Failed to bind to address ..."
        raise BindFailed(
            f"cannot serve on {address}: the port is taken or the address is not this host's ({e})"
        ) from None
    return BoundServer(server, health, port, credentials is not None)


async def start_grpc(
    bound: BoundServer, settings: WorkerSettings, repository: Repository
) -> GrpcServer:
    """The bound server with the inference service over `repository`, started."""
    limits = Limits(
        max_elements=settings.max_message_bytes, max_bytes_elements=settings.max_bytes_elements
    )
    roofs = Roofs.from_setting(settings.roofline_profile, settings.intra_op_threads)
    servicer = WorkerServicer(repository, limits, roofs)
    bound.server.add_generic_rpc_handlers([handler(servicer)])
    await bound.server.start()
    return GrpcServer(bound.server, bound.health, bound.port, bound.tls, servicer)


def register(
    settings: WorkerSettings, repository: Repository, grpc_server: GrpcServer
) -> Registration | None:
    """Registration in Redis (heartbeat, depth, KV room, loads), when a Redis URL is set."""
    if not settings.redis_url:
        return None
    registration = Registration(
        settings.redis_url,
        worker_info(settings, repository, grpc_server.port),
        depth=lambda: sum(m.depth for m in repository.all()),
        kv=lambda: kv_tokens(repository),
        service=lambda: service_rates(repository),
        loads=lambda: scaling_loads(repository),
        heartbeat_s=settings.heartbeat_seconds,
        ttl_s=settings.registry_ttl_seconds,
        depth_interval_s=settings.depth_interval_seconds,
        password=read_password(settings.redis_password, settings.redis_password_file),
    )
    registration.start()
    grpc_server.servicer.on_request = registration.activity
    log.info("worker_registering", worker=registration.info.id, redis=settings.redis_url)
    return registration


async def stop_failed(
    why: str,
    grpc_server: GrpcServer,
    registration: Registration | None,
    group: TpRepository | None,
) -> NoReturn:
    """A failed shard group: NOT_SERVING, deregister, cut calls, abort; no drain."""
    log.error("worker_group_failed", reason=why)
    deadline = threading.Timer(FAILED_EXIT_S, _exit_failed)
    deadline.daemon = True
    deadline.start()
    grpc_server.servicer.ready = False
    await grpc_server.health.enter_graceful_shutdown()  # NOT_SERVING
    if registration is not None:
        await registration.deregister(DEREGISTER_S)
    await grpc_server.server.stop(0.5)
    if group is not None:
        group.abort()
    raise GroupFailed(why)


async def drain(
    settings: WorkerSettings,
    repository: Repository,
    grpc_server: GrpcServer,
    registration: Registration | None,
) -> None:
    """SIGTERM: leave the registry, wait for routers to notice, finish in-flight calls."""
    log.info("worker_draining", grace_seconds=settings.grace_seconds)
    if registration is not None:
        # Routers stop picking us (what is not removed within DEREGISTER_S expires with
        # its TTL)...
        await registration.deregister(DEREGISTER_S)
        await asyncio.sleep(settings.drain_seconds)  # ...once they next read the registry
    grpc_server.servicer.ready = False
    await grpc_server.health.enter_graceful_shutdown()  # NOT_SERVING, and stays so
    await grpc_server.server.stop(settings.grace_seconds)  # refuse new calls, finish in-flight
    await repository.close()
    log.info("worker_stopped")


def drain_budget(settings: WorkerSettings) -> float:
    """Seconds a drain may take, from SIGTERM to exit, before the watchdog ends it."""
    return DEREGISTER_S + settings.drain_seconds + settings.grace_seconds + DRAIN_SLACK_S


def kv_tokens(repository: Repository) -> tuple[int, int]:
    """(used, total) KV cache tokens over the worker's LLM models."""
    pairs = [m.kv_tokens for m in repository.all()]
    return sum(u for u, _ in pairs), sum(t for _, t in pairs)


def service_rates(repository: Repository) -> tuple[int, int]:
    """(slots, requests finished per 1,000 s) over the worker's LLM models: what the
    routers predict a new request's queue wait from (router/forwarding/shedding.py)."""
    slots = rate = 0.0
    for m in repository.all():
        if m.llm is not None:
            s, r = m.llm.service_rate()
            slots, rate = slots + s, rate + r
    return int(slots), int(rate * 1000)


def scaling_loads(repository: Repository) -> dict[str, ModelLoad]:
    """Per model: its versions' requests waiting + running and KV tokens (worker/scaling.py)."""
    return model_loads(
        {
            name: [(m.depth, *m.kv_tokens) for m in versions.values()]
            for name, versions in repository.models.items()
        }
    )


def worker_info(settings: WorkerSettings, repository: Repository, port: int) -> WorkerInfo:
    models = {}
    for name, versions in repository.models.items():
        latest = repository.get(name)
        models[name] = ModelEntry(
            versions=sorted(versions, key=int),
            max_queue=latest.max_queue_size,
            price_micro_usd=int(latest.spec.parameters.get(PRICE_PER_CALL, "0")),
            price_per_1k_input_tokens_micro_usd=int(
                latest.spec.parameters.get(PRICE_PER_1K_INPUT, "0")
            ),
            price_per_1k_output_tokens_micro_usd=int(
                latest.spec.parameters.get(PRICE_PER_1K_OUTPUT, "0")
            ),
            price_per_1k_cached_input_tokens_micro_usd=(
                int(cached) if (cached := latest.spec.parameters.get(PRICE_CACHED)) else None
            ),
            training_cost_micro_usd=int(latest.spec.parameters.get(TRAINING_COST, "0")),
        )
    return WorkerInfo(
        id=settings.worker_id or f"worker-{settings.host}-{port}",
        address=settings.advertise_address or f"{settings.host}:{port}",
        models=models,
        provider=",".join(sorted(repository.providers)),
        tp=max(settings.tp, 1),
        started_ms=now_ms(),
    )
