"""The one forward path: pick a replica, forward a request, fail over, count it.

ModelInfer and every request of a ModelStreamInfer go through the same steps here (a unary
call is a stream of one response); only the transport to the worker differs (a unary call
or a worker stream, see `_Upstream`):

    guard = dispatcher.guard(raw, tenant, streamed)    # parse the header: the guard
    await dispatcher.admit(guard)                      # the tenant's limits, in-flight limits
    async for reply in dispatcher.responses(guard, raw, deadline):  # pick, forward, failover
        receipt, record = guard.bill(reply.piece, reply.ends, reply.code)
        ...  # wait for the record (Accounting.durable), deliver, guard.refund if undelivered
    guard.close(code)                                  # release the slot, count; an error
                                                       # is recorded if it ended without one

`infer` is that loop for a unary call (one reply, billed once it is in Redis), and
router/forwarding/streams.py runs it for each request of a stream. An HTTP front end builds the
ModelInferRequest bytes itself and calls `infer`, or `StreamForwarder.serve` for a stream.

The request arrives as bytes and leaves as the same bytes: only its header (model, version,
id) is parsed; a header that does not parse is INVALID_ARGUMENT. The router admits at most
`max_inflight` calls at once, and `max_inflight_per_model` per model: beyond them a call is
answered RESOURCE_EXHAUSTED at once instead of queueing inside the router; and with a
queue-wait bound, not a call whose model's predicted wait is over it
(router/forwarding/shedding.py).
To an LLM's replicas the router adds the request parameters `tenant` and `tenant_weight`
from the caller's key (`with_tenant`; auth off: the default tenant), replacing any the client
sent: the engines' fair admission shares by them.

Billing (see router/money/guard.py): a unary call counts as a success only when the router
answers OK. A call cancelled by its client, or whose deadline passes, before that is an
error; one answered with less than `answer_margin_s` of its deadline left is
DEADLINE_EXCEEDED (the reply could not reach the client in time); one answered OK whose
client turned out to be gone is refunded by the servicer (see `settle`). A call in flight to
a replica that leaves the registry (a stopped worker stops its heartbeat) is cancelled and
retried on another replica, or answered UNAVAILABLE; so is one to a replica that stalls (no
depth sample, no health answer). A client-chosen model or version becomes a metric label or
a ledger row only when the mesh serves it; anything else is `_unknown_`.

One retry on another replica after UNAVAILABLE (a dead or unreachable worker, which is then
ejected) or RESOURCE_EXHAUSTED (its queue filled since the last sample), while the caller's
deadline allows and before any response of the request was forwarded; never after
INVALID_ARGUMENT, NOT_FOUND and the like. A stream of an LLM that breaks with UNAVAILABLE
after pieces were forwarded moves to another replica, resumed from the token ids its client
was sent, up to `migration_limit` times (router/forwarding/migration.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from common import llm_protocol
from common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
    Unavailable,
    UpstreamError,
    clip,
)
from common.mesh_state import ModelEntry
from protos.routing_pb2 import InferHeader
from router.forwarding import policies
from router.forwarding.affinity import Affinity, session_of
from router.forwarding.migration import DEFAULT_LIMIT, Migration
from router.forwarding.prefix_index import PrefixIndex
from router.forwarding.registry import Registry
from router.forwarding.replica import Replica
from router.forwarding.routing import Picker
from router.forwarding.shedding import Shedder
from router.money import billing
from router.money.accounting import Accounting, Receipt
from router.money.billing import Piece
from router.money.guard import OK, UNKNOWN, Admission, RequestGuard
from router.telemetry import metrics
from router.tenancy.auth import Auth, Tenant

log = structlog.get_logger()

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
__all__ = ["RETRYABLE", "UNKNOWN", "Dispatcher", "Reply", "RequestGuard"]


@dataclass(frozen=True)
class Reply:
    """One response of a request as it came from the worker. `raw` None: the worker's
    stream closed without a final response (nothing to forward, only the end to record).
    `ends`: the request's last response; `code`: OK, or UNKNOWN for an error response."""

    raw: bytes | None
    piece: Piece | None
    ends: bool
    code: grpc.StatusCode = OK


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
        prefix_weight: float = policies.PREFIX_WEIGHT,
        prefix_index_blocks: int = 200_000,
        shedder: Shedder | None = None,
        migration_limit: int = DEFAULT_LIMIT,
    ) -> None:
        self.registry = registry
        self.accounting = accounting
        self.affinity = Affinity(max_sessions)
        index = PrefixIndex(prefix_index_blocks)
        setup = policies.Setup(rng or random.Random(), index, prefix_weight)
        self.picker = Picker(
            policies.build(policy_name, setup), sample_max_age_ms, self.affinity, index
        )
        self.default_timeout_s = default_timeout_s
        self.admission = Admission(max_inflight, max_inflight_per_model)
        self.answer_margin_s = answer_margin_s
        self.auth = auth  # tenants: models and limits (None: auth off)
        self.shedder = shedder  # the queue-wait bound (None: off)
        self.migration_limit = migration_limit  # per streamed request (forwarding/migration.py)

    def pick(
        self,
        replicas: list[Replica],
        model: str,
        session: str | None = None,
        raw: bytes | None = None,
    ) -> Replica:
        """One of `replicas` (of `model`) by the policy (see router.forwarding.routing)."""
        live = self.registry.replicas if self.registry is not None else None
        return self.picker.pick(replicas, model, session, raw, live)

    # -- one request -----------------------------------------------------------------------

    def guard(self, raw: bytes, tenant: Tenant | None, streamed: bool = False) -> RequestGuard:
        """The guard of one request (a serialized ModelInferRequest; `streamed`: one request
        of a ModelStreamInfer), from its header. InvalidArgument (counted) when the header
        does not parse."""
        try:
            header = InferHeader.FromString(raw)
        except DecodeError as e:
            metrics.REQUESTS.labels(UNKNOWN, "INVALID_ARGUMENT").inc()
            raise InvalidArgument(
                f"the request does not parse as a ModelInferRequest: {clip(str(e), 120)}"
            ) from None
        guard = RequestGuard(
            self.accounting,
            self.admission,
            header.id,
            header.model_name,
            header.model_version,
            tenant,
            session_of(header.parameters),
            streamed,
        )
        found = self.entry(guard.model, guard.asked_version, None)
        if found is not None:
            guard.serve(*found)
        return guard

    async def admit(self, guard: RequestGuard) -> None:
        """Let the request in: its tenant (auth on) allowed the model and within its limits,
        then the router's in-flight limits (for a model the mesh serves). MeshError when
        refused; the caller ends the guard with its code (a tenant's refusal is counted in
        the metrics, not recorded as a call: the router's own refusal is an error)."""
        if guard.tenant is not None and self.auth is not None:
            try:
                await self.auth.admit(guard.tenant, guard.model)
            except MeshError:
                guard.refused = True  # counted in metrics, not a call of the model's
                raise
        if guard.entry is not None:
            if self.shedder is not None:
                try:
                    self.shedder.check(
                        guard.model,
                        guard.priority,
                        self.registry.replicas_for(guard.model, guard.asked_version),
                        self.admission.by_model[guard.model],
                    )
                except ResourceExhausted:
                    guard.shed = True  # a call of the model, refused before it started
                    raise
            guard.admit()

    async def responses(
        self, guard: RequestGuard, raw: bytes, deadline: float | None
    ) -> AsyncGenerator[Reply, None]:
        """Forward one request to a replica of its model and yield the worker's responses
        as they come, the last one with `ends`; on a worker stream when the guard is
        `streamed`, else as a unary call (one response). Fails over once (see the module
        docstring); raises MeshError when the request ends without a response of its own.
        `deadline` is time.monotonic()-based."""
        replicas = self.registry.replicas_for(guard.model, guard.asked_version)
        if not replicas:
            raise self.registry.unserved(guard.model, guard.asked_version)
        if any(r.sample is not None and (r.sample.kv_total or r.sample.slots) for r in replicas):
            raw = with_tenant(raw, guard.tenant)  # an LLM: its engines share by tenant
        migration = Migration.of(raw, self.migration_limit) if guard.streamed else None
        request = raw if migration is None else migration.asked
        tried: set[str] = set()
        while True:
            pool = [r for r in replicas if r.id not in tried and not r.ejected and not r.dropped]
            if not pool:
                raise Unavailable(
                    f"no healthy replica of model {clip(guard.model)}: "
                    f"{len(replicas)} known, all failed or ejected"
                )
            replica = self.pick(pool, guard.model, guard.session, raw)
            found = self.entry(guard.model, guard.asked_version, replica)
            if found is not None:  # billed as the replica that answers serves it
                guard.serve(*found)
            timeout = self.default_timeout_s if deadline is None else deadline - time.monotonic()
            if timeout <= 0:
                raise UpstreamError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before forwarding"
                )
            forwarded = False
            try:
                async with aclosing(self._attempt(replica, guard, request, timeout)) as replies:
                    async for reply in replies:
                        forwarded = True
                        if migration is not None:
                            migration.observe(reply.piece)
                        yield reply
                return
            except UpstreamError as e:
                status = e.code
                tried.add(replica.id)
                # the replicas now: a long stream may outlive every one it started with
                replicas = self.registry.replicas_for(guard.model, guard.asked_version)
                # One retry, and only where another replica can take it: with none left the
                # caller gets this worker's own status (RESOURCE_EXHAUSTED stays that).
                another = any(
                    r.id not in tried and not r.ejected and not r.dropped for r in replicas
                )
                if migration is not None and another and migration.allows(status):
                    request = migration.next_request()
                    metrics.MIGRATIONS.labels(guard.label).inc()
                    log.info(
                        "migrating_stream",
                        id=clip(guard.id),
                        worker=replica.id,
                        model=guard.model,
                        tokens=len(migration.ids),
                        migration=migration.done,
                    )
                    continue
                if not forwarded and status in RETRYABLE and len(tried) == 1 and another:
                    metrics.RETRIES.labels(status.name).inc()
                    event = "retrying_stream" if guard.streamed else "retrying"
                    log.info(event, worker=replica.id, code=status.name, model=guard.model)
                    continue
                if guard.streamed:
                    log.warning(
                        "stream_failed", worker=replica.id, code=status.name, model=guard.model
                    )
                raise

    async def _attempt(
        self, replica: Replica, guard: RequestGuard, raw: bytes, timeout: float
    ) -> AsyncGenerator[Reply, None]:
        """One attempt: the request on one replica, as a unary call or a worker stream; its
        responses as they come, with the replica's bookkeeping around it (in-flight token
        and gauge, the calls the registry may abandon, eject on UNAVAILABLE) and the time
        upstream added to the guard. A failure raises UpstreamError with the worker's code."""
        registry = self.registry
        token = registry.begin(replica)
        metrics.INFLIGHT.labels(replica.id).inc()
        t0 = time.perf_counter()
        call: Any = (
            replica.stream(timeout=timeout)
            if guard.streamed
            else replica.infer(raw, timeout=timeout)
        )
        replica.calls.add(call)
        ended = False
        try:
            if not guard.streamed:
                response = await call
                replica.heard_at = time.monotonic()
                ended = True
                yield Reply(response, None, True)
                return
            await call.write(raw)
            await call.done_writing()
            while (response := await call.read()) is not grpc.aio.EOF:
                replica.heard_at = time.monotonic()
                assert isinstance(response, bytes)
                piece = billing.stream_piece(response)
                ends = (piece.final or bool(piece.error)) and not ended
                if ends:  # its time upstream is counted with its end
                    t0 = _add_upstream(guard, t0)
                ended = ended or ends
                yield Reply(response, piece, ends, grpc.StatusCode.UNKNOWN if piece.error else OK)
            if not ended:  # the worker's stream closed OK without a final response
                t0 = _add_upstream(guard, t0)
                ended = True
                yield Reply(None, None, True)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call not in replica.abandoned or (task is not None and task.cancelling()):
                raise  # our own caller went away (a stream's worker call is cancelled below)
            # The registry gave up on the replica (left, or stalled) and cancelled this call.
            raise UpstreamError(
                grpc.StatusCode.UNAVAILABLE, "the replica stopped answering"
            ) from None
        except grpc.aio.AioRpcError as e:
            status, details = e.code(), e.details() or e.code().name
            if status == grpc.StatusCode.UNAVAILABLE:
                registry.eject(replica, details)
                metrics.EJECTIONS.labels(replica.id).inc()
            if not ended:  # once answered, a late transport error changes nothing
                raise UpstreamError(status, details) from None
        finally:
            if guard.streamed:
                call.cancel()  # no-op once it ended; else the worker aborts the request
            replica.calls.discard(call)
            replica.abandoned.discard(call)
            _add_upstream(guard, t0)
            registry.end(replica, token)
            metrics.INFLIGHT.labels(replica.id).dec()

    # -- a unary call ----------------------------------------------------------------------

    async def infer(
        self, raw: bytes, deadline: float | None, tenant: Tenant | None = None
    ) -> tuple[bytes, Receipt | None]:
        """Forward one ModelInfer request (serialized); `deadline` is time.monotonic()-based;
        `tenant` (auth on) must be allowed the model and within its limits.

        A success is answered once its record is in Redis (group commit, see accounting).
        Returns the reply and, for a recorded success, the receipt `settle` takes."""
        guard = self.guard(raw, tenant)
        try:
            await self.admit(guard)
            reply = None
            async with aclosing(self.responses(guard, raw, deadline)) as replies:
                async for reply in replies:  # noqa: B007 (one reply: the last is kept)
                    pass
            assert reply is not None and reply.raw is not None  # a unary call has one
            self._check_margin(deadline)
        except MeshError as e:
            guard.close(e.code)
            raise
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed
            guard.close(_cut(deadline))
            raise
        guard.release()
        piece = billing.unary_piece(reply.raw) if guard.meter is not None else None
        receipt, record = guard.bill(piece, ends=True)
        if record is None or self.accounting is None:
            guard.count(OK)
            return reply.raw, None
        assert receipt is not None  # a success
        try:
            if not await self.accounting.durable(record):
                if self.accounting.when_slow == "unavailable":
                    raise Unavailable(
                        f"the call's record did not reach Redis within "
                        f"{self.accounting.wait_s}s; it is not billed, retry"
                    )
                metrics.REPLIES_BEFORE_DURABLE.inc()
            self._check_margin(deadline)
        except MeshError as e:
            guard.count(e.code)
            guard.refund(receipt)
            raise
        except BaseException:
            guard.count(grpc.StatusCode.CANCELLED)
            guard.refund(receipt)
            raise
        guard.count(OK)
        return reply.raw, receipt

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


def with_tenant(raw: bytes, tenant: Tenant | None) -> bytes:
    """The request with its `tenant` and `tenant_weight` parameters set from the key (auth
    off: the default tenant, ""): a serialized map entry appended to a message replaces the
    one of the same key parsed before it, so the client's own values are overwritten without
    decoding the request."""
    header = InferHeader()
    header.parameters[llm_protocol.TENANT].string_param = tenant.name if tenant else ""
    weight = tenant.policy.weight if tenant else 1.0
    header.parameters[llm_protocol.TENANT_WEIGHT].double_param = weight
    return raw + header.SerializeToString()


def _cut(deadline: float | None) -> grpc.StatusCode:
    """The code of a request cut by its client: its deadline passed, or it cancelled."""
    late = deadline is not None and time.monotonic() >= deadline
    return grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED


def _add_upstream(guard: RequestGuard, since: float) -> float:
    now = time.perf_counter()
    guard.upstream_s += now - since
    return now
