"""ModelStreamInfer on the router: a real stream both ways, bytes untouched, billed as it goes.

Each request on the client's stream is forwarded on a worker stream of its own, to one
replica picked as ModelInfer picks (same policy, same admission limits): the request pins to
that replica for all its responses. Every response the worker sends is passed back as it
comes, its bytes untouched (`triton_final_response` and all); the responses of the stream's
requests interleave as they come. Only headers are parsed: the request's InferHeader to
route it, the response's usage parameters to bill it (see `billing`).

Ends of a request:

- its final response (flagged `triton_final_response`, or the one response of a model that
  is not decoupled) is forwarded: a success;
- the worker answers with an error response: forwarded, an error;
- the replica dies, is ejected as stalled (a SIGSTOPped worker: no depth sample, no health
  answer; see Registry), or the call fails otherwise: the client gets an error response for
  that request at once, `error_message` "UNAVAILABLE: ..." (the gRPC code name first), and
  the stream stays open for its other requests. An error response rather than ending the
  RPC, because one client stream multiplexes requests that may be pinned to other, healthy
  replicas, and Triton reports a request's failure the same way. Before any response was
  forwarded, an UNAVAILABLE or RESOURCE_EXHAUSTED is retried once on another replica;
- the client cancels the stream or its deadline passes: every worker stream of it is
  cancelled (the worker aborts the generation), and the unfinished requests are errors.
  (A router that dies ends the client's RPC with UNAVAILABLE: the transport closes.)

Billing: a response that carries token counts is billed before it is forwarded: its tokens
(the difference from what the call already billed) are recorded, and the response waits
until that record is in Redis (group commit: every response ready at once shares one wait),
as a unary reply does. A response whose write then fails (the client went away before gRPC
took it for the transport) is refunded; one gRPC took is billed, even if the client's
cancel interrupted the write's caller (see `_send`). A final response is billed with its
call's success. So a stream cut mid-way is billed exactly the tokens of the pieces its
client was sent, and counted as an error; a router killed mid-stream has billed at most the
pieces it was forwarding at that instant beyond what the client received.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import structlog
from google.protobuf.message import DecodeError

from common.errors import MeshError, clip
from common.mesh_state import ModelEntry
from protos import grpc_service_pb2 as pb
from protos.routing_pb2 import InferHeader
from router import billing, metrics
from router.accounting import NO_TOKENS, Receipt, Tokens
from router.affinity import session_of
from router.auth import Tenant
from router.billing import Piece
from router.dispatch import RETRYABLE, UNKNOWN, Dispatcher
from router.registry import Replica

log = structlog.get_logger()

OK = grpc.StatusCode.OK

Send = Callable[[bytes], Awaitable[None]]


def _written(write: asyncio.Future) -> bool:
    return not write.cancelled() and write.exception() is None


@dataclass(eq=False)
class _Call:
    """One request on the client's stream."""

    id: str
    model: str
    version: str  # as asked; the billed version once `entry` is known
    entry: ModelEntry | None = None
    meter: billing.TokenMeter | None = None
    ended: bool = False
    upstream_s: float = 0.0
    session: str | None = None  # session_id / conversation_id: affinity (router/affinity.py)
    started: float = field(default_factory=time.perf_counter)
    last_piece: float | None = None  # when the last piece carrying tokens was forwarded
    tokens_out: int = 0  # completion tokens forwarded so far

    def observe(self, piece: billing.Piece) -> None:
        """TTFT, inter-token latency and tokens, from the running counts on each piece."""
        if piece.completion_tokens is None or piece.completion_tokens <= self.tokens_out:
            return
        now = time.perf_counter()
        new = piece.completion_tokens - self.tokens_out
        if self.last_piece is None:
            metrics.TTFT.labels(self.label).observe(now - self.started)
            if piece.prompt_tokens:
                metrics.TOKENS.labels(self.label, "in").inc(piece.prompt_tokens)
        else:
            metrics.INTER_TOKEN.labels(self.label).observe((now - self.last_piece) / new)
        metrics.TOKENS.labels(self.label, "out").inc(new)
        self.last_piece, self.tokens_out = now, piece.completion_tokens

    @property
    def label(self) -> str:
        return self.model if self.entry is not None else UNKNOWN


@dataclass(eq=False)
class _Item:
    """A response to forward (raw None: nothing to forward, only the end to record)."""

    call: _Call
    raw: bytes | None
    piece: Piece | None = None
    ends: bool = False
    code: grpc.StatusCode = OK
    receipt: Receipt | None = field(default=None, init=False)


class StreamForwarder:
    """One client's ModelStreamInfer."""

    def __init__(
        self, dispatcher: Dispatcher, deadline: float | None, tenant: Tenant | None = None
    ) -> None:
        self.dispatcher = dispatcher
        self.tenant = tenant  # whose stream (auth on): each request checked and billed
        self.tenant_name = tenant.name if tenant else ""
        self.registry = dispatcher.registry
        self.accounting = dispatcher.accounting
        self.deadline = deadline
        self.out: asyncio.Queue[_Item | None] = asyncio.Queue()
        self.calls: set[_Call] = set()

    async def serve(self, requests: AsyncIterator[bytes], send: Send) -> None:
        """Forward `requests`' responses with `send` (the RPC's write) until the client's
        side ends and every request has ended."""
        tasks: set[asyncio.Task] = set()

        async def read() -> None:
            async for raw in requests:
                task = asyncio.create_task(self._request(raw))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await self.out.put(None)

        reader = asyncio.create_task(read())
        try:
            done = False
            while not done:
                batch: list[_Item] = []
                item = await self.out.get()
                while item is not None:
                    batch.append(item)
                    if self.out.empty():
                        break
                    item = self.out.get_nowait()
                done = item is None
                try:
                    await self._bill(batch)
                except BaseException:  # the client went away while the records were written
                    for unsent in batch:
                        self._take_back(unsent)
                    raise
                for i, item in enumerate(batch):
                    try:
                        if item.raw is not None:
                            await self._send(item, send)
                    except BaseException:
                        for unsent in batch[i + 1 :]:  # the rest did not go out
                            self._take_back(unsent)
                        raise
                    if item.ends:  # a long-lived stream keeps no state of finished requests
                        self.calls.discard(item.call)
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            late = self.deadline is not None and time.monotonic() >= self.deadline
            code = grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED
            for call in self.calls:
                if not call.ended:  # cut before its end: an error, its pieces billed
                    self._record_end(call, code, None)

    # -- billing ---------------------------------------------------------------------------

    async def _bill(self, batch: list[_Item]) -> None:
        """Record what the batch's responses bill; wait until Redis has it."""
        futures = []
        for item in batch:
            call = item.call
            tokens = NO_TOKENS
            if call.meter is not None and item.piece is not None:
                tokens = call.meter.advance(item.piece)
            if item.ends:
                finish = item.piece.finish_reason if item.piece else None
                item.receipt, future = self._record_end(call, item.code, finish, tokens)
            elif tokens != NO_TOKENS and self.accounting is not None:
                assert call.entry is not None
                future = self.accounting.record_tokens(
                    call.model, call.version, tokens, self.tenant_name
                )
                item.receipt = Receipt(
                    call.model, call.version, 0, tokens, call=False, tenant=self.tenant_name
                )
            else:
                continue
            if future is not None and future not in futures:
                futures.append(future)
        if self.accounting is not None:
            for future in futures:
                if not await self.accounting.durable(future):
                    metrics.REPLIES_BEFORE_DURABLE.inc()

    def _record_end(
        self,
        call: _Call,
        code: grpc.StatusCode,
        finish: str | None,
        tokens: Tokens = NO_TOKENS,
    ) -> tuple[Receipt | None, asyncio.Future | None]:
        call.ended = True
        metrics.REQUESTS.labels(call.label, code.name).inc()
        metrics.LATENCY.labels("upstream").observe(call.upstream_s)
        if self.accounting is None or call.entry is None:
            return None, None
        ok = code == OK
        price = call.entry.price_micro_usd
        if call.meter is None:
            finish = None
        elif ok:
            finish = finish or ""
        upstream_ns = int(call.upstream_s * 1e9)
        tenant = self.tenant_name
        future = self.accounting.record(
            call.model, call.version, ok, price, upstream_ns, tokens, finish, tenant
        )
        if ok:
            return Receipt(call.model, call.version, price, tokens, finish, tenant=tenant), future
        if tokens != NO_TOKENS:
            return Receipt(call.model, call.version, 0, tokens, call=False, tenant=tenant), future
        return None, future

    async def _send(self, item: _Item, send: Send) -> None:
        """Write one response. The write runs shielded: when the client's cancel interrupts
        this task mid-write, the write itself still ends one way or the other, and the
        response's billing is settled by that: kept if gRPC took the message for the
        transport, taken back if it failed. (Judged by this task's interruption instead, a
        final response the client had already read was refunded as never sent.)"""
        assert item.raw is not None
        write = asyncio.ensure_future(send(item.raw))
        try:
            await asyncio.shield(write)
        except BaseException:
            write.add_done_callback(lambda w: None if _written(w) else self._take_back(item))
            raise

    def _take_back(self, item: _Item) -> None:
        """A response billed but not forwarded (the client went away)."""
        receipt = item.receipt
        if receipt is None:
            return
        if item.call.meter is not None:
            item.call.meter.take_back(receipt.tokens)
        self.dispatcher.refund(receipt)

    # -- forwarding ------------------------------------------------------------------------

    async def _request(self, raw: bytes) -> None:
        try:
            header = InferHeader.FromString(raw)
        except DecodeError as e:
            call = _Call("", "", "")
            self.calls.add(call)
            message = f"the request does not parse as a ModelInferRequest: {clip(str(e), 120)}"
            await self._fail(call, grpc.StatusCode.INVALID_ARGUMENT, message)
            return
        call = _Call(header.id, header.model_name, header.model_version)
        call.session = session_of(header.parameters)
        self.calls.add(call)
        if self.tenant is not None and self.dispatcher.auth is not None:
            try:
                await self.dispatcher.auth.admit(self.tenant, call.model)
            except MeshError as e:  # not its model, or over a limit: this request only
                await self._fail(call, e.code, e.message, e.trailers)
                return
        replicas = self.registry.replicas_for(call.model, call.version)
        found = self.dispatcher.entry(call.model, call.version, None) if replicas else None
        if found is None:
            error = self.registry.unserved(call.model, call.version)
            await self._fail(call, error.code, error.message)
            return
        call.entry, call.version = found
        if billing.priced_per_token(call.entry):
            call.meter = billing.TokenMeter.of(call.entry)
        try:
            self.dispatcher.admit(call.model)
        except Exception as e:
            await self._fail(call, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        try:
            await self._forward(raw, call, replicas)
        finally:
            self.dispatcher.release(call.model)

    async def _forward(self, raw: bytes, call: _Call, replicas: list[Replica]) -> None:
        tried: set[str] = set()
        while True:
            pool = [r for r in replicas if r.id not in tried and not r.ejected and not r.dropped]
            if not pool:
                message = (
                    f"no healthy replica of model {clip(call.model)}: "
                    f"{len(replicas)} known, all failed or ejected"
                )
                await self._fail(call, grpc.StatusCode.UNAVAILABLE, message)
                return
            try:
                replica = self.dispatcher.pick(pool, call.model, call.session)
            except Exception as e:  # every replica at its max queue
                await self._fail(call, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                return
            timeout = (
                self.dispatcher.default_timeout_s
                if self.deadline is None
                else self.deadline - time.monotonic()
            )
            if timeout <= 0:
                message = "deadline passed before forwarding"
                await self._fail(call, grpc.StatusCode.DEADLINE_EXCEEDED, message)
                return
            status, details, forwarded = await self._attempt(raw, call, replica, timeout)
            if status == OK:
                return
            tried.add(replica.id)
            another = any(r.id not in tried and not r.ejected and not r.dropped for r in replicas)
            if not forwarded and status in RETRYABLE and len(tried) == 1 and another:
                metrics.RETRIES.labels(status.name).inc()
                log.info("retrying_stream", worker=replica.id, code=status.name, model=call.model)
                continue
            log.warning("stream_failed", worker=replica.id, code=status.name, model=call.model)
            await self._fail(call, status, details)
            return

    async def _attempt(
        self, raw: bytes, call: _Call, replica: Replica, timeout: float
    ) -> tuple[grpc.StatusCode, str, bool]:
        """One worker stream for one request: (status, details, any response forwarded)."""
        token = self.registry.begin(replica)
        metrics.INFLIGHT.labels(replica.id).inc()
        t0 = time.perf_counter()
        stream = replica.stream(timeout=timeout)
        replica.calls.add(stream)
        forwarded = ended = False
        try:
            await stream.write(raw)
            await stream.done_writing()
            while (response := await stream.read()) is not grpc.aio.EOF:
                replica.heard_at = time.monotonic()
                assert isinstance(response, bytes)
                piece = billing.stream_piece(response)
                call.observe(piece)
                ends = piece.final or bool(piece.error)
                code = grpc.StatusCode.UNKNOWN if piece.error else OK
                if ends and not ended:  # its time upstream is counted with its end
                    t0 = _add_upstream(call, t0)
                await self.out.put(_Item(call, response, piece, ends and not ended, code))
                forwarded = True
                ended = ended or ends
            if not ended:  # the worker's stream closed OK without a final response
                t0 = _add_upstream(call, t0)
                await self.out.put(_Item(call, None, None, True, OK))
            return OK, "", forwarded
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if stream not in replica.abandoned or (task is not None and task.cancelling()):
                raise  # the client went away: the worker stream is cancelled below
            # The registry gave up on the replica (left, or stalled) and cancelled this call.
            return grpc.StatusCode.UNAVAILABLE, "the replica stopped answering", forwarded
        except grpc.aio.AioRpcError as e:
            status, details = e.code(), e.details() or e.code().name
            if status == grpc.StatusCode.UNAVAILABLE:
                self.registry.eject(replica, details)
                metrics.EJECTIONS.labels(replica.id).inc()
            if ended:  # the request was answered; a late transport error changes nothing
                return OK, "", forwarded
            return status, details, forwarded
        finally:
            stream.cancel()  # no-op once it ended; else the worker aborts the request
            replica.calls.discard(stream)
            replica.abandoned.discard(stream)
            _add_upstream(call, t0)
            self.registry.end(replica, token)
            metrics.INFLIGHT.labels(replica.id).dec()

    async def _fail(
        self,
        call: _Call,
        code: grpc.StatusCode,
        message: str,
        trailers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """End a request with an error response on the stream, the code's name first. What a
        unary call gets as trailing metadata (a refusal's `retry-after` and `limit`) is in the
        response's parameters: a stream has one trailer, at its end, not one per request."""
        response = pb.ModelStreamInferResponse(
            error_message=f"{code.name}: {message}",
            infer_response=pb.ModelInferResponse(id=call.id, model_name=call.model),
        )
        for name, value in trailers:
            response.infer_response.parameters[name].string_param = value
        await self.out.put(_Item(call, response.SerializeToString(), None, True, code))


def _add_upstream(call: _Call, since: float) -> float:
    now = time.perf_counter()
    call.upstream_s += now - since
    return now
