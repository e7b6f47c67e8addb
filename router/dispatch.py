"""Pick a replica, forward the call, fail over, count it.

The request arrives as bytes and leaves as the same bytes: only its header (model, version,
id) is parsed; a header that does not parse is INVALID_ARGUMENT. The router admits at most
`max_inflight` calls at once, and `max_inflight_per_model` per model: beyond them a call is
answered RESOURCE_EXHAUSTED at once instead of queueing inside the router.

Billing: a call counts as a success only when the router answers OK. A call cancelled by its
client, or whose deadline passes, before that is an error; one answered with less than
`answer_margin_s` of its deadline left is DEADLINE_EXCEEDED (the reply could not reach the
client in time); one answered OK whose client turned out to be gone is refunded by the
servicer (see `settle`). A call in flight to a replica that leaves the registry (a stopped
worker stops its heartbeat) is cancelled and retried on another replica, or answered
UNAVAILABLE; so is one to a replica that stalls (no depth sample, no health answer).
A client-chosen model or version becomes a metric label or a ledger row only
when the mesh serves it; anything else is `_unknown_`.

One retry on another replica after UNAVAILABLE (a dead or unreachable worker, which is then
ejected) or RESOURCE_EXHAUSTED (its queue filled since the last sample), while
the caller's deadline allows; never after INVALID_ARGUMENT, NOT_FOUND and the like.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import structlog
from google.protobuf.message import DecodeError

from common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
    Unavailable,
    UpstreamError,
    clip,
)
from common.mesh_state import ModelEntry, now_ms
from protos.routing_pb2 import InferHeader
from router import billing, metrics, policy
from router.accounting import NO_TOKENS, Accounting, Receipt
from router.affinity import Affinity, session_of
from router.auth import Auth, Tenant
from router.registry import Registry, Replica

log = structlog.get_logger()

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
UNKNOWN = "_unknown_"  # the one label and ledger version for what the mesh does not serve


class Dispatcher:
    def __init__(
        self,
        registry: Registry,
        accounting: Accounting | None,
        policy_name: str = "p2c",
        sample_max_age_ms: int = 1000,
        default_timeout_s: float = 60.0,
        rng: random.Random | None = None,
        max_inflight: int = 1024,
        max_inflight_per_model: int = 512,
        answer_margin_s: float = 0.002,
        max_sessions: int = 100_000,
        auth: Auth | None = None,
    ) -> None:
        if policy_name not in policy.POLICIES:
            raise ValueError(f"unknown policy {policy_name!r}; choose one of {policy.POLICIES}")
        self.registry = registry
        self.accounting = accounting
        self.policy = policy_name
        self.sample_max_age_ms = sample_max_age_ms
        self.default_timeout_s = default_timeout_s
        self.rng = rng or random.Random()
        self.max_inflight = max_inflight
        self.max_inflight_per_model = max_inflight_per_model
        self.answer_margin_s = answer_margin_s
        self.affinity = Affinity(max_sessions)
        self.auth = auth  # tenants: models and limits (None: auth off)
        self._tick = 0
        self._inflight = 0
        self._inflight_by_model: Counter[str] = Counter()

    def pick(self, replicas: list[Replica], model: str, session: str | None = None) -> Replica:
        """One of `replicas` (of `model`) by the policy; the replica that served `session`
        before while it has room (see policy.choose, router.affinity)."""
        now = now_ms()
        by_id = {r.id: r for r in replicas}
        fresh = [
            r.sample
            for r in replicas
            if r.sample is not None
            and r.sample.kv_total
            and now - r.sample.at_ms <= self.sample_max_age_ms
        ]
        need = policy.kv_need((s.depth, s.kv_used) for s in fresh)
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
                policy.kv_free(
                    r.sample.kv_used,
                    r.sample.kv_total,
                    r.sample.at_ms,
                    now,
                    self.sample_max_age_ms,
                )
                if r.sample
                else None,
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
        preferred = self.affinity.get(model, session)
        chosen = policy.choose(self.policy, open_, self.rng, self._tick, need, preferred)
        if session is not None:
            outcome = "new" if preferred is None else "hit" if chosen.id == preferred else "moved"
            metrics.AFFINITY.labels(outcome).inc()
            self.affinity.remember(model, session, chosen.id)
        if self.policy == "p2c" and not chosen.has_room(need):
            metrics.KV_NO_ROOM.inc()  # every replica's cache was full: it waits there
        return by_id[chosen.id]

    async def infer(
        self, raw: bytes, deadline: float | None, tenant: Tenant | None = None
    ) -> tuple[bytes, Receipt | None]:
        """Forward one ModelInfer request (serialized); `deadline` is time.monotonic()-based;
        `tenant` (auth on) must be allowed the model and within its limits.

        A success is answered once its record is in Redis (group commit, see accounting).
        Returns the reply and, for a recorded success, the receipt `settle` takes."""
        start = time.perf_counter()
        try:
            header = InferHeader.FromString(raw)
        except DecodeError as e:
            metrics.REQUESTS.labels(UNKNOWN, "INVALID_ARGUMENT").inc()
            raise InvalidArgument(
                f"the request does not parse as a ModelInferRequest: {clip(str(e), 120)}"
            ) from None
        model, version = header.model_name, header.model_version
        served = bool(self.registry.replicas_for(model))
        attempt = _Attempt(session=session_of(header.parameters), tenant=tenant)
        code = grpc.StatusCode.UNKNOWN  # until the call ends one way or another
        admitted = False
        reply = b""
        try:
            if tenant is not None and self.auth is not None:
                await self.auth.admit(tenant, model)
            if served:
                self.admit(model)
                admitted = True
            reply = await self._forward(raw, model, version, deadline, attempt)
            self._check_margin(deadline)
            code = grpc.StatusCode.OK
        except MeshError as e:
            code = e.code
            raise
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed
            late = deadline is not None and time.monotonic() >= deadline
            code = grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED
            raise
        finally:
            if admitted:
                self.release(model)
            label = model if served else UNKNOWN
            if code != grpc.StatusCode.OK:  # an OK is counted once it is sure (below)
                metrics.REQUESTS.labels(label, code.name).inc()
            metrics.LATENCY.labels("upstream").observe(attempt.upstream_s)
            metrics.LATENCY.labels("router").observe(
                time.perf_counter() - start - attempt.upstream_s
            )
            recorded = self._account(model, version, attempt, code, reply)
        if recorded is None or self.accounting is None:
            metrics.REQUESTS.labels(label, code.name).inc()
            return reply, None
        future, receipt = recorded
        assert receipt is not None  # code is OK here
        try:
            durable = await self.accounting.durable(future)
            if not durable:
                if self.accounting.when_slow == "unavailable":
                    raise Unavailable(
                        f"the call's record did not reach Redis within "
                        f"{self.accounting.wait_s}s; it is not billed, retry"
                    )
                metrics.REPLIES_BEFORE_DURABLE.inc()
            self._check_margin(deadline)
        except MeshError as e:
            metrics.REQUESTS.labels(label, e.code.name).inc()
            self.refund(receipt)
            raise
        except BaseException:
            metrics.REQUESTS.labels(label, grpc.StatusCode.CANCELLED.name).inc()
            self.refund(receipt)
            raise
        metrics.REQUESTS.labels(label, code.name).inc()
        return reply, receipt

    def settle(self, receipt: Receipt, delivered: bool) -> None:
        """Once the RPC is over: a success whose reply did not reach its client is refunded."""
        if not delivered:
            self.refund(receipt)

    def refund(self, receipt: Receipt) -> None:
        if self.accounting is not None:
            self.accounting.refund(receipt)
            metrics.REFUNDS.inc()

    def _check_margin(self, deadline: float | None) -> None:
        if deadline is not None and deadline - time.monotonic() < self.answer_margin_s:
            raise DeadlineExceeded("the reply was ready too close to the deadline to reach it")

    def admit(self, model: str) -> None:
        if self._inflight >= self.max_inflight:
            metrics.REJECTED.labels("total").inc()
            raise ResourceExhausted(
                f"the router has {self._inflight} calls in flight, its limit; retry later"
            )
        if self._inflight_by_model[model] >= self.max_inflight_per_model:
            metrics.REJECTED.labels("model").inc()
            raise ResourceExhausted(
                f"the router has {self._inflight_by_model[model]} calls to model "
                f"{clip(model)} in flight, its per-model limit; retry later"
            )
        self._inflight += 1
        self._inflight_by_model[model] += 1

    def release(self, model: str) -> None:
        self._inflight -= 1
        self._inflight_by_model[model] -= 1
        if not self._inflight_by_model[model]:
            del self._inflight_by_model[model]

    async def _forward(
        self, raw: bytes, model: str, version: str, deadline: float | None, attempt: _Attempt
    ) -> bytes:
        replicas = self.registry.replicas_for(model, version)
        if not replicas:
            raise self.registry.unserved(model, version)
        tried: set[str] = set()
        while True:
            pool = [r for r in replicas if r.id not in tried and not r.ejected and not r.dropped]
            if not pool:
                raise Unavailable(
                    f"no healthy replica of model {clip(model)}: "
                    f"{len(replicas)} known, all failed or ejected"
                )
            replica = self.pick(pool, model, attempt.session)
            attempt.replica = replica
            timeout = self.default_timeout_s if deadline is None else deadline - time.monotonic()
            if timeout <= 0:
                raise UpstreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before forwarding"
                )
            token = self.registry.begin(replica)
            metrics.INFLIGHT.labels(replica.id).inc()
            t0 = time.perf_counter()
            call = replica.infer(raw, timeout=timeout)
            replica.calls.add(call)
            try:
                reply: bytes = await call
                replica.heard_at = time.monotonic()
                return reply
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if call not in replica.abandoned or (task is not None and task.cancelling()):
                    raise  # our own caller went away
                # The registry gave up on the replica and cancelled this call (see Registry).
                status, details = grpc.StatusCode.UNAVAILABLE, "the replica stopped answering"
            except grpc.aio.AioRpcError as e:
                status, details = e.code(), e.details() or e.code().name
                if status == grpc.StatusCode.UNAVAILABLE:
                    self.registry.eject(replica, details)
                    metrics.EJECTIONS.labels(replica.id).inc()
            finally:
                replica.calls.discard(call)
                replica.abandoned.discard(call)
                attempt.upstream_s += time.perf_counter() - t0
                self.registry.end(replica, token)
                metrics.INFLIGHT.labels(replica.id).dec()
            tried.add(replica.id)
            # One retry, and only where another replica can take it: with none left the
            # caller gets this worker's own status (RESOURCE_EXHAUSTED stays that).
            another = any(r.id not in tried and not r.ejected and not r.dropped for r in replicas)
            if status in RETRYABLE and len(tried) == 1 and another:
                metrics.RETRIES.labels(status.name).inc()
                log.info("retrying", worker=replica.id, code=status.name, model=model)
                continue
            raise UpstreamError(status, details)

    def entry(
        self, model: str, version: str, replica: Replica | None
    ) -> tuple[ModelEntry, str] | None:
        """The model's registration and the version its counts go under; None for a model
        no replica serves (nothing to attribute the call to)."""
        replicas = [replica] if replica else self.registry.replicas_for(model)
        entry = next((r.info.models[model] for r in replicas if model in r.info.models), None)
        if entry is None:
            return None
        if version and version not in entry.versions:
            version = UNKNOWN  # a client-chosen string never becomes a row of its own
        return entry, version or entry.versions[-1]

    def _account(
        self, model: str, version: str, attempt: _Attempt, code: grpc.StatusCode, reply: bytes
    ) -> tuple[asyncio.Future, Receipt | None] | None:
        if self.accounting is None:
            return None
        found = self.entry(model, version, attempt.replica)
        if found is None:
            return None
        entry, version = found
        ok = code == grpc.StatusCode.OK
        price = entry.price_micro_usd
        tokens, finish = NO_TOKENS, None
        if ok and billing.priced_per_token(entry):  # an LLM answering a unary call
            piece = billing.unary_piece(reply)
            tokens, finish = billing.TokenMeter.of(entry).advance(piece), piece.finish_reason or ""
        upstream_ns = int(attempt.upstream_s * 1e9)
        tenant = attempt.tenant.name if attempt.tenant else ""
        future = self.accounting.record(
            model, version, ok, price, upstream_ns, tokens, finish, tenant
        )
        return future, Receipt(model, version, price, tokens, finish, tenant=tenant) if ok else None


@dataclass
class _Attempt:
    """What one call went through: the replica that answered (or last tried), time upstream,
    and its session."""

    replica: Replica | None = None
    upstream_s: float = 0.0
    session: str | None = None  # the conversation it belongs to (router.affinity)
    tenant: Tenant | None = None  # whose call (auth on)
