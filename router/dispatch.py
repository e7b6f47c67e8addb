"""Pick a replica, forward the call, fail over, count it.

The request arrives as bytes and leaves as the same bytes: only its header (model, version,
id) is parsed. One retry on another replica after UNAVAILABLE (a dead or unreachable worker,
which is then ejected) or RESOURCE_EXHAUSTED (its queue filled since the last sample), while
the caller's deadline allows; never after INVALID_ARGUMENT, NOT_FOUND and the like.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import grpc
import structlog
from google.protobuf.message import DecodeError

from common.errors import (
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    UpstreamError,
)
from common.mesh_state import now_ms
from protos.routing_pb2 import InferHeader
from router import metrics, policy
from router.accounting import Accounting
from router.registry import Registry, Replica

log = structlog.get_logger()

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class Dispatcher:
    def __init__(
        self,
        registry: Registry,
        accounting: Accounting | None,
        policy_name: str = "p2c",
        sample_max_age_ms: int = 1000,
        default_timeout_s: float = 60.0,
        rng: random.Random | None = None,
    ) -> None:
        if policy_name not in policy.POLICIES:
            raise ValueError(f"unknown policy {policy_name!r}; choose one of {policy.POLICIES}")
        self.registry = registry
        self.accounting = accounting
        self.policy = policy_name
        self.sample_max_age_ms = sample_max_age_ms
        self.default_timeout_s = default_timeout_s
        self.rng = rng or random.Random()
        self._tick = 0

    def pick(self, replicas: list[Replica], model: str) -> Replica:
        now = now_ms()
        by_id = {r.id: r for r in replicas}
        candidates = [
            policy.Candidate(
                r.id,
                policy.load(
                    r.sample.depth if r.sample else None,
                    r.sample.at_ms if r.sample else None,
                    r.inflight.values(),
                    now,
                    self.sample_max_age_ms,
                ),
                r.info.models[model].max_queue,
            )
            for r in replicas
        ]
        open_ = [c for c in candidates if not c.full]
        if not open_:
            raise ResourceExhausted(
                f"every replica of model {model!r} is at its max queue "
                f"({', '.join(f'{c.id}: {c.load}/{c.max_queue}' for c in candidates)}); "
                "retry later"
            )
        self._tick += 1
        return by_id[policy.choose(self.policy, open_, self.rng, self._tick).id]

    async def infer(self, raw: bytes, deadline: float | None) -> bytes:
        """Forward one ModelInfer request (serialized); `deadline` is time.monotonic()-based.

        A success is answered once its record is in Redis (group commit, see accounting)."""
        start = time.perf_counter()
        try:
            header = InferHeader.FromString(raw)
        except DecodeError as e:
            raise InvalidArgument(f"the request is not a valid ModelInferRequest ({e})") from None
        model, version = header.model_name, header.model_version
        attempt = _Attempt()
        code = grpc.StatusCode.OK
        try:
            reply = await self._forward(raw, model, version, deadline, attempt)
        except MeshError as e:
            code = e.code
            raise
        finally:
            metrics.REQUESTS.labels(model, code.name).inc()
            metrics.LATENCY.labels("upstream").observe(attempt.upstream_s)
            metrics.LATENCY.labels("router").observe(
                time.perf_counter() - start - attempt.upstream_s
            )
            recorded = self._account(model, version, attempt, code)
        if recorded is not None and self.accounting is not None:
            await self.accounting.durable(recorded)
        return reply

    async def _forward(
        self, raw: bytes, model: str, version: str, deadline: float | None, attempt: _Attempt
    ) -> bytes:
        replicas = self.registry.replicas_for(model, version)
        if not replicas:
            known = sorted({m for r in self.registry.replicas.values() for m in r.info.models})
            what = f"model {model!r}" + (f" version {version!r}" if version else "")
            raise NotFound(f"no replica serves {what}; the mesh serves {known}")
        tried: set[str] = set()
        while True:
            pool = [r for r in replicas if r.id not in tried and not r.ejected]
            if not pool:
                raise Unavailable(
                    f"no healthy replica of model {model!r}: "
                    f"{len(replicas)} known, all failed or ejected"
                )
            replica = self.pick(pool, model)
            attempt.replica = replica
            timeout = self.default_timeout_s if deadline is None else deadline - time.monotonic()
            if timeout <= 0:
                raise UpstreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before forwarding"
                )
            token = self.registry.begin(replica)
            metrics.INFLIGHT.labels(replica.id).inc()
            t0 = time.perf_counter()
            try:
                reply: bytes = await replica.infer(raw, timeout=timeout)
                return reply
            except grpc.aio.AioRpcError as e:
                status = e.code()
                if status == grpc.StatusCode.UNAVAILABLE:
                    self.registry.eject(replica, e.details() or status.name)
                    metrics.EJECTIONS.labels(replica.id).inc()
                tried.add(replica.id)
                # One retry, and only where another replica can take it: with none left the
                # caller gets this worker's own status (RESOURCE_EXHAUSTED stays that).
                another = any(r.id not in tried and not r.ejected for r in replicas)
                if status in RETRYABLE and len(tried) == 1 and another:
                    metrics.RETRIES.labels(status.name).inc()
                    log.info("retrying", worker=replica.id, code=status.name, model=model)
                    continue
                raise UpstreamError(status, e.details() or status.name) from None
            finally:
                attempt.upstream_s += time.perf_counter() - t0
                self.registry.end(replica, token)
                metrics.INFLIGHT.labels(replica.id).dec()

    def _account(
        self, model: str, version: str, attempt: _Attempt, code: grpc.StatusCode
    ) -> asyncio.Future | None:
        if self.accounting is None:
            return None
        replicas = [attempt.replica] if attempt.replica else self.registry.replicas_for(model)
        entry = next((r.info.models[model] for r in replicas if model in r.info.models), None)
        if entry is None:  # a model no replica serves: nothing to attribute the call to
            return None
        return self.accounting.record(
            model,
            version or entry.versions[-1],
            code == grpc.StatusCode.OK,
            entry.price_micro_usd,
            int(attempt.upstream_s * 1e9),
        )


@dataclass
class _Attempt:
    """What one call went through: the replica that answered (or last tried), time upstream."""

    replica: Replica | None = None
    upstream_s: float = 0.0
