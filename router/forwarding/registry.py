"""The router's view of the mesh, kept from Redis; the last known view when Redis is down.

Pushed, with a slow poll as the safety net: the router subscribes to the workers' registry
events (mesh_state.REGISTRY_EVENTS) and applies each as it comes: a depth sample updates
its replica (a worker it does not know yet is read from Redis), a join reads that one
registration, a leave (the worker drains) removes its replica at once, letting the calls in
flight to it finish. Every `poll_s` (1 s), and on each (re)subscription for what was
published while it was not listening, it reads every registration and depth, as it did 20
times a second before: the cost of an idle mesh no longer grows with polls.

One `Replica` (router/forwarding/replica.py) per registered worker; its ejection, stall probes and
re-admission are router/forwarding/replica_health.py's. A worker missing from Redis is dropped only
after it has been missing for the registry TTL, counted from the later of its last sighting
and Redis's return after an outage: a Redis that comes back empty (after an outage of any
length) must not empty the mesh before the workers' next heartbeat. A dropped replica's
calls in flight are cancelled at once, so the dispatcher can retry them elsewhere instead of
waiting on a worker that stopped.

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
from typing import Any

import grpc
import structlog
from redis.exceptions import RedisError

from common import mesh_state, redis_conn, tls
from common.errors import MeshError, NotFound, Unavailable, clip
from common.mesh_state import DepthSample, RegistryEvent, WorkerInfo, now_ms
from common.outage import Outage
from router.forwarding.replica import Replica
from router.forwarding.replica_health import HOUSEKEEPING_S, ReplicaHealth
from router.telemetry import metrics

log = structlog.get_logger()

MAX_LEFT = 10_000  # models remembered as served once (see Registry.unserved)
LEAVE_GRACE_S = 30.0  # for the calls in flight to a worker that deregistered (it drains)


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
        self.health = ReplicaHealth(self.redis, self._spawn, eject_base_s, eject_max_s, stall_s)
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
            self.health.check(self.replicas.values())

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
            replica.abandon()
        await replica.channel.close(grace=1.0 if abandon else LEAVE_GRACE_S)

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
        """A call to it failed: no new calls for a backoff (router/forwarding/replica_health.py)."""
        self.health.eject(replica, reason)
