"""ModelStreamInfer on the router: a real stream both ways, bytes untouched, billed as it goes.

Each request on the client's stream is forwarded on a worker stream of its own by the one
forward path ModelInfer takes (router/forwarding/dispatch.py: same guard, policy, admission limits,
failover): the request pins to the replica picked for all its responses. Every response
the worker sends is passed back as it comes, its bytes untouched (`triton_final_response`
and all); the responses of the stream's requests interleave as they come. Only headers are
parsed: the request's InferHeader to route it, the response's usage parameters to bill it
(see `billing`).

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
  forwarded, an UNAVAILABLE or RESOURCE_EXHAUSTED is retried once on another replica; an
  LLM stream broken by UNAVAILABLE after pieces were forwarded migrates instead: it goes on
  on another replica from the token ids its client was sent, and the client sees one
  unbroken stream (router/forwarding/migration.py; the worker's pieces then carry
  `token_ids`, which the router asks for on every stream);
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
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from common.errors import MeshError
from protos import grpc_service_pb2 as pb
from router.forwarding.dispatch import Dispatcher
from router.money.accounting import Receipt
from router.money.billing import Piece
from router.money.guard import OK, RequestGuard
from router.telemetry import metrics
from router.tenancy.auth import Tenant

Send = Callable[[bytes], Awaitable[None]]


def _written(write: asyncio.Future) -> bool:
    return not write.cancelled() and write.exception() is None


@dataclass(eq=False)
class _Item:
    """A response to forward (raw None: nothing to forward, only the end to record); guard
    None: a request whose header did not parse (nothing to bill)."""

    guard: RequestGuard | None
    raw: bytes | None
    piece: Piece | None = None
    ends: bool = False
    code: grpc.StatusCode = OK
    receipt: Receipt | None = field(default=None, init=False)


class StreamForwarder:
    """One client's ModelStreamInfer (an HTTP stream can be served the same way: `serve`
    with the request bytes it built and its own `send`)."""

    def __init__(
        self, dispatcher: Dispatcher, deadline: float | None, tenant: Tenant | None = None
    ) -> None:
        self.dispatcher = dispatcher
        self.tenant = tenant  # whose stream (auth on): each request checked and billed
        self.accounting = dispatcher.accounting
        self.deadline = deadline
        self.out: asyncio.Queue[_Item | None] = asyncio.Queue()
        self.guards: set[RequestGuard] = set()

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
                await self._deliver(batch, send)
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            late = self.deadline is not None and time.monotonic() >= self.deadline
            code = grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED
            for guard in self.guards:  # cut before its end: an error, its pieces billed
                guard.close(code)

    async def _deliver(self, batch: list[_Item], send: Send) -> None:
        """Bill the batch, then write it; what did not go out is taken back."""
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
            if item.ends and item.guard is not None:  # a long-lived stream keeps no state
                self.guards.discard(item.guard)  # of finished requests

    # -- billing ---------------------------------------------------------------------------

    async def _bill(self, batch: list[_Item]) -> None:
        """Record what the batch's responses bill; wait until Redis has it."""
        futures = []
        for item in batch:
            guard = item.guard
            if guard is None:
                continue
            item.receipt, future = guard.bill(item.piece, item.ends, item.code)
            if item.ends:
                guard.count(item.code)
            if future is not None and future not in futures:
                futures.append(future)
        if self.accounting is not None:
            for future in futures:
                if not await self.accounting.durable(future):
                    metrics.REPLIES_BEFORE_DURABLE.inc()

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
        if item.guard is not None:
            item.guard.refund(item.receipt)

    # -- forwarding ------------------------------------------------------------------------

    async def _request(self, raw: bytes) -> None:
        """One request of the stream, by the dispatcher's one forward path; a request that
        ends without a response of its own gets an error response."""
        try:
            guard = self.dispatcher.guard(raw, self.tenant, streamed=True)
        except MeshError as e:  # its header does not parse
            self._fail(None, e.code, e.message)
            return
        self.guards.add(guard)
        try:
            await self.dispatcher.admit(guard)  # not its model, or over a limit: this one only
            replies = self.dispatcher.responses(guard, raw, self.deadline)
            async with aclosing(replies) as responses:
                async for reply in responses:
                    item = _Item(guard, reply.raw, reply.piece, reply.ends, reply.code)
                    self.out.put_nowait(item)
        except MeshError as e:
            self._fail(guard, e.code, e.message, e.trailers)
        finally:
            guard.release()

    def _fail(
        self,
        guard: RequestGuard | None,
        code: grpc.StatusCode,
        message: str,
        trailers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """End a request with an error response on the stream, the code's name first. What a
        unary call gets as trailing metadata (a refusal's `retry-after` and `limit`) is in the
        response's parameters: a stream has one trailer, at its end, not one per request."""
        response = pb.ModelStreamInferResponse(
            error_message=f"{code.name}: {message}",
            infer_response=pb.ModelInferResponse(
                id=guard.id if guard else "", model_name=guard.model if guard else ""
            ),
        )
        for name, value in trailers:
            response.infer_response.parameters[name].string_param = value
        self.out.put_nowait(_Item(guard, response.SerializeToString(), None, True, code))
