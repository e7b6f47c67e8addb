"""Replica health, as the router judges it: ejection with exponential backoff after a
failed call, a health probe of a replica whose calls are in flight but whose depth sample
stopped moving, and re-admission once the worker's grpc.health.v1 check says SERVING. The
registry (router/forwarding/registry.py) owns the replicas and runs `check` every HOUSEKEEPING_S."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import mesh_state
from common.mesh_state import DepthSample, now_ms
from router.forwarding.replica import Replica

log = structlog.get_logger()

HOUSEKEEPING_S = 0.05  # ejected replicas' health checks, stalled replicas' probes


class ReplicaHealth:
    def __init__(
        self,
        redis: Redis,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        eject_base_s: float = 1.0,
        eject_max_s: float = 30.0,
        stall_s: float = 1.0,
    ) -> None:
        self.redis = redis  # for a stalled replica's last depth sample
        self._spawn = spawn  # a task the registry keeps (and cancels on close)
        self.eject_base_s = eject_base_s
        self.eject_max_s = eject_max_s
        self.stall_s = stall_s

    def eject(self, replica: Replica, reason: str) -> None:
        replica.backoff_s = min(
            self.eject_max_s, replica.backoff_s * 2 if replica.backoff_s else self.eject_base_s
        )
        replica.ejected_until = time.monotonic() + replica.backoff_s
        log.warning(
            "replica_ejected", worker=replica.id, reason=reason, backoff_s=replica.backoff_s
        )

    def check(self, replicas: Iterable[Replica]) -> None:
        """One housekeeping round (every HOUSEKEEPING_S): health checks for the ejected
        replicas whose backoff ran out, probes for the ones that look stalled."""
        replicas = list(replicas)
        self._check_ejected(replicas)
        self._check_stalled(replicas)

    def _check_ejected(self, replicas: list[Replica]) -> None:
        now = time.monotonic()
        for replica in replicas:
            if replica.backoff_s and not replica.checking and now >= replica.ejected_until:
                replica.checking = True
                self._spawn(self._health_check(replica))

    def _check_stalled(self, replicas: list[Replica]) -> None:
        """A replica with calls in flight whose depth sample stopped moving (a worker
        publishes one every 100 ms; a stopped or wedged process does not) gets a health
        probe, at most once per `stall_s`; no answer within it ejects the replica and
        abandons its calls at once, rather than after the registry TTL."""
        now, now_unix_ms = time.monotonic(), now_ms()
        for replica in replicas:
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
                self._spawn(self._probe(replica))

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
            replica.abandon()

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
