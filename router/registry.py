"""The router's view of the mesh, kept from Redis; the last known view when Redis is down.

Pushed, with a slow poll as the safety net: the router subscribes to the workers' registry
events (mesh_state.REGISTRY_EVENTS) and applies each as it comes: a depth sample updates
its replica (a worker it does not know yet is read from Redis), a join reads that one
registration, a leave (the worker drains) removes its replica at once, letting the calls in
flight to it finish. Every `poll_s` (1 s), and on each (re)subscription for what was
published while it was not listening, it reads every registration and depth, as it did 20
times a second before: the cost of an idle mesh no longer grows with polls.

One `Replica` per registered worker, with the one gRPC channel the router reuses for it, the
worker's last depth sample, the router's own in-flight calls to it, and its ejection state.
A worker missing from Redis is dropped only after it has been missing for the registry TTL,
counted from the later of its last sighting and Redis's return after an outage: a Redis that
comes back empty (after an outage of any length) must not empty the mesh before the
workers' next heartbeat. A dropped replica's calls in flight are cancelled at once, so the
dispatcher can retry them elsewhere instead of waiting on a worker that stopped.

What Redis holds is checked before it is used: a registration that does not parse as a
WorkerInfo, or that prices a model differently from the replicas already serving it, is
ignored with one log line per registration text (Redis ACLs limit who may write it; see
devmesh/redis_acl.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

from common import mesh_state, redis_conn, tls
from common.errors import MeshError, NotFound, Unavailable, clip
from common.mesh_state import DepthSample, RegistryEvent, WorkerInfo, now_ms
from common.outage import Outage
from router import metrics

log = structlog.get_logger()

HOUSEKEEPING_S = 0.05  # ejected replicas' health checks, stalled replicas' probes
MAX_LEFT = 10_000  # models remembered as served once (see Registry.unserved)
LEAVE_GRACE_S = 30.0  # for the calls in flight to a worker that deregistered (it drains)
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


class Registry:
    def __init__(
        self,
        redis_url: str,
        channel_options: list[tuple[str, int]],
        poll_s: float = 1.0,
        ttl_s: float = 5.0,
        eject_base_s: float = 1.0,
        eject_max_s: float = 30.0,
        stall_s: float = 1.0,
        password: str | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.redis = redis_conn.connect_async(
            redis_url, password=password, timeout_s=0.5, connect_timeout_s=0.5
        )
        self.channel_options = channel_options
        self.channel_credentials = channel_credentials  # mutual TLS to the workers
        self.poll_s = poll_s
        self.ttl_s = ttl_s
        self.eject_base_s = eject_base_s
        self.eject_max_s = eject_max_s
        self.stall_s = stall_s
        self.replicas: dict[str, Replica] = {}
        self.left: dict[str, float] = {}  # model -> when its last replica known here left
        self.redis_state = Outage(
            "redis_unreachable_using_last_known_registry", "redis_reconnected"
        )
        self._tokens = itertools.count()
        self._refused: dict[str, str] = {}  # worker id -> registration text refused last
        self._tasks: list[asyncio.Task] = []
        self._checks: set[asyncio.Task] = set()
        self._refreshing = asyncio.Lock()
        self._fetching: set[str] = set()  # worker ids whose registration is being read
        self._left: dict[str, str] = {}  # worker id -> registration text it deregistered

    async def start(self) -> None:
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._poll()),
            loop.create_task(self._housekeeping()),
            loop.create_task(self._listen()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._checks, return_exceptions=True)
        for replica in self.replicas.values():
            await replica.channel.close()
        await self.redis.aclose()

    async def _poll(self) -> None:
        """The safety net: a full read of the registry every `poll_s`."""
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            self._check_ejected()
            self._check_stalled()

    async def _listen(self) -> None:
        """Apply the workers' registry events as they come; subscribe again after a Redis
        error, then read the whole registry for what was missed meanwhile."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(mesh_state.REGISTRY_EVENTS)
                await self.refresh()
                while True:
                    message = await pubsub.get_message(timeout=self.poll_s)
                    if message is not None:
                        self._on_event(message["data"])
            except (RedisError, OSError) as e:
                self.redis_state.failed(e)
                await asyncio.sleep(min(self.poll_s, 0.5))
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    def _on_event(self, data: str) -> None:
        try:
            event = RegistryEvent.decode(data)
        except ValueError as e:
            log.warning("registry_event_refused", reason=str(e)[:200])
            return
        replica = self.replicas.get(event.worker_id)
        if event.kind == "depth" and replica is not None:
            replica.last_seen = time.monotonic()
            self._observe(replica, event.sample)
        elif event.kind == "leave":
            if replica is not None:  # it said so itself: no new calls; those in flight finish
                # A registry read under way may still hold this registration: not again.
                self._left[event.worker_id] = replica.info_json
                self._spawn(self._remove(event.worker_id, "deregistered", abandon=False))
        elif event.worker_id not in self._fetching:  # a join, or depth of a worker not known
            if event.kind == "join":
                self._left.pop(event.worker_id, None)
            self._fetching.add(event.worker_id)
            self._spawn(self._fetch(event.worker_id))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _fetch(self, worker_id: str) -> None:
        """Read one worker's registration and depth (it joined, or sent a depth unknown)."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(mesh_state.worker_key(worker_id))
                pipe.get(mesh_state.depth_key(worker_id))
                info_json, depth = await pipe.execute()
        except (RedisError, OSError) as e:
            self.redis_state.failed(e)
            return
        finally:
            self._fetching.discard(worker_id)
        if info_json is not None:
            self._upsert(worker_id, info_json, depth)

    async def refresh(self) -> None:
        async with self._refreshing:
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            cutoff = now_ms() - int(self.ttl_s * 1000)
            ids = await self.redis.zrangebyscore(mesh_state.WORKERS, cutoff, "+inf")
            infos, depths = [], []
            if ids:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.mget([mesh_state.worker_key(i) for i in ids])
                    pipe.mget([mesh_state.depth_key(i) for i in ids])
                    infos, depths = await pipe.execute()
        except (RedisError, OSError) as e:
            self.redis_state.failed(e)
            return
        now = time.monotonic()
        if not self.redis_state.up:
            # Back after an outage: the TTL counts again from now, so the workers get one
            # TTL to re-register in a Redis that may have come back empty.
            for replica in self.replicas.values():
                replica.last_seen = now
        self.redis_state.succeeded()
        self._left = {i: text for i, text in self._left.items() if i in ids}
        seen = set()
        for worker_id, info_json, depth in zip(ids, infos, depths, strict=True):
            if info_json is None:
                continue
            if self._upsert(worker_id, info_json, depth):
                seen.add(worker_id)
        for worker_id in [i for i, r in self.replicas.items() if i not in seen]:
            if now - self.replicas[worker_id].last_seen > self.ttl_s:
                await self._remove(worker_id, "left the registry")

    def _upsert(self, worker_id: str, info_json: str, depth: str | None) -> bool:
        """Admit or refresh one registration; False when it is refused."""
        replica = self.replicas.get(worker_id)
        if replica is None or replica.info_json != info_json:
            if info_json in (self._refused.get(worker_id), self._left.get(worker_id)):
                return False
            try:
                info = WorkerInfo.from_json(info_json)
                if info.id != worker_id:
                    raise ValueError(f"registered under id {worker_id!r} but says {info.id!r}")
                self._check_prices(info)
            except ValueError as e:
                self._refused[worker_id] = info_json
                log.warning("registration_refused", worker=worker_id[:64], reason=str(e)[:300])
                return False
            self._refused.pop(worker_id, None)
            replica = self._admit(worker_id, info, replica)
            replica.info_json = info_json
        replica.last_seen = time.monotonic()
        if depth is not None:
            self._observe(replica, depth)
        return True

    @staticmethod
    def _observe(replica: Replica, text: str) -> None:
        """A depth sample, unless one taken later is already known (an event can overtake
        a registry read that was under way)."""
        try:
            sample = DepthSample.decode(text)
        except ValueError:
            replica.sample = None  # unknown depth: only our own in-flight calls count
            metrics.forget_replica(replica.id)
            return
        if replica.sample is None or sample.at_ms >= replica.sample.at_ms:
            replica.sample = sample
            metrics.observe_sample(replica.id, sample.depth, sample.kv_used, sample.kv_total)

    def _check_prices(self, info: WorkerInfo) -> None:
        """A model costs the same on every replica: a registration that disagrees with the
        replicas already serving the model is refused, not billed at its own price."""
        for name, entry in info.models.items():
            for other in self.replicas.values():
                theirs = other.info.models.get(name)
                if other.id != info.id and theirs is not None:
                    mine = (*entry.prices, entry.cached_input_price)
                    if (*theirs.prices, theirs.cached_input_price) != mine:
                        raise ValueError(
                            f"prices model {name!r} at {mine} micro-USD (per call, per 1k "
                            f"input, output and cached input tokens); replica {other.id!r} "
                            f"serves it at {(*theirs.prices, theirs.cached_input_price)}"
                        )
                    break

    def _admit(self, worker_id: str, info: WorkerInfo, replica: Replica | None) -> Replica:
        """A new worker, or a registration that changed."""
        if replica is not None and (
            replica.info.address != info.address or replica.info.started_ms != info.started_ms
        ):
            # Moved, or the same worker id came back as a new process: a fresh channel and
            # a clean record (the old process's failures and ejection are history).
            asyncio.get_running_loop().create_task(replica.channel.close())
            replica = None
        if replica is None:
            channel = tls.aio_channel(info.address, self.channel_credentials, self.channel_options)
            replica = Replica(info, channel)
            self.replicas[worker_id] = replica
            log.info(
                "replica_joined",
                worker=info.id,
                address=info.address,
                models=sorted(info.models),
                provider=info.provider,
                tp=info.tp,
            )
        replica.info = info
        return replica

    async def _remove(self, worker_id: str, reason: str, abandon: bool = True) -> None:
        """Forget a replica. Its calls in flight are abandoned (retried elsewhere), or for a
        worker that deregistered (it drains), left up to LEAVE_GRACE_S to finish."""
        replica = self.replicas.pop(worker_id, None)
        if replica is None:
            return
        replica.dropped = True
        now = time.monotonic()
        for model in replica.info.models:
            self.left[model] = now
        while len(self.left) > MAX_LEFT:  # oldest first (insertion order)
            del self.left[next(iter(self.left))]
        metrics.forget_replica(worker_id)
        log.info("replica_left", worker=worker_id, reason=reason, inflight=len(replica.calls))
        if abandon:
            self._abandon(replica)
        await replica.channel.close(grace=1.0 if abandon else LEAVE_GRACE_S)

    @staticmethod
    def _abandon(replica: Replica) -> None:
        """Cancel the calls in flight to a replica that stopped answering: the dispatcher
        sees them as UNAVAILABLE and retries them elsewhere."""
        for call in list(replica.calls):
            replica.abandoned.add(call)
            call.cancel()

    def unserved(self, model: str, version: str = "") -> MeshError:
        """The error for a call no replica can take: UNAVAILABLE for a model whose last
        replica left (a restart, a scale-down: retry), NOT_FOUND for one never served."""
        what = f"model {clip(model)}" + (f" version {clip(version)}" if version else "")
        left = self.left.get(model)
        served = any(model in r.info.models for r in self.replicas.values())
        if left is not None and not served:  # served, but not this version: NOT_FOUND
            return Unavailable(
                f"no replica serves {what} now: the last one left "
                f"{time.monotonic() - left:.1f} s ago; retry later"
            )
        known = sorted({m for r in self.replicas.values() for m in r.info.models})
        return NotFound(f"no replica serves {what}; the mesh serves {clip(str(known), 200)}")

    def replicas_for(self, model: str, version: str = "") -> list[Replica]:
        return [
            r
            for r in self.replicas.values()
            if model in r.info.models and (not version or version in r.info.models[model].versions)
        ]

    def begin(self, replica: Replica) -> int:
        token = next(self._tokens)
        replica.inflight[token] = now_ms()
        return token

    def end(self, replica: Replica, token: int) -> None:
        replica.inflight.pop(token, None)

    def eject(self, replica: Replica, reason: str) -> None:
        replica.backoff_s = min(
            self.eject_max_s, replica.backoff_s * 2 if replica.backoff_s else self.eject_base_s
        )
        replica.ejected_until = time.monotonic() + replica.backoff_s
        log.warning(
            "replica_ejected", worker=replica.id, reason=reason, backoff_s=replica.backoff_s
        )

    def _check_ejected(self) -> None:
        now = time.monotonic()
        for replica in self.replicas.values():
            if replica.backoff_s and not replica.checking and now >= replica.ejected_until:
                replica.checking = True
                task = asyncio.get_running_loop().create_task(self._health_check(replica))
                self._checks.add(task)
                task.add_done_callback(self._checks.discard)

    def _check_stalled(self) -> None:
        """A replica with calls in flight whose depth sample stopped moving (a worker
        publishes one every 100 ms; a stopped or wedged process does not) gets a health
        probe, at most once per `stall_s`; no answer within it ejects the replica and
        abandons its calls at once, rather than after the registry TTL."""
        now, now_unix_ms = time.monotonic(), now_ms()
        for replica in self.replicas.values():
            if (
                replica.calls
                and not replica.checking
                and not replica.backoff_s
                and now - replica.probed_at >= self.stall_s
                and (
                    replica.sample is None
                    or now_unix_ms - replica.sample.at_ms > self.stall_s * 1000
                )
            ):
                replica.checking = True
                replica.probed_at = now
                task = asyncio.get_running_loop().create_task(self._probe(replica))
                self._checks.add(task)
                task.add_done_callback(self._checks.discard)

    async def _probe(self, replica: Replica) -> None:
        began = time.monotonic()
        try:
            stub = health_pb2_grpc.HealthStub(replica.channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.stall_s)
            healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
            if not healthy:
                healthy = await self._busy_not_stalled(replica, began)
        except grpc.aio.AioRpcError:
            healthy = await self._busy_not_stalled(replica, began)
        finally:
            replica.checking = False
        if not healthy and not replica.dropped:
            self.eject(replica, "stalled: no depth sample and no health answer")
            self._abandon(replica)

    async def _busy_not_stalled(self, replica: Replica, began: float) -> bool:
        """A probe that timed out may only mean a busy loop here or there (a burst of a
        thousand streams): the replica is alive if it answered a call since the probe began
        or has published a depth sample within the stall window, read from Redis now."""
        if replica.heard_at >= began:
            return True
        try:
            raw = await self.redis.get(mesh_state.depth_key(replica.id))
        except (RedisError, OSError):
            return False
        if raw is None:
            return False
        try:
            sample = DepthSample.decode(raw)
        except ValueError:
            return False
        return now_ms() - sample.at_ms <= self.stall_s * 1000

    async def _health_check(self, replica: Replica) -> None:
        """Re-admit an ejected replica once its gRPC health check says SERVING."""
        try:
            stub = health_pb2_grpc.HealthStub(replica.channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            healthy = False
        finally:
            replica.checking = False
        if healthy:
            replica.backoff_s = 0.0
            replica.ejected_until = 0.0
            log.info("replica_readmitted", worker=replica.id)
        else:
            self.eject(replica, "health check failed")
