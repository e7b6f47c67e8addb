"""ModelStreamInfer on the worker (the router forwards streams as bytes:
router/forwarding/streams.py): every request on a stream runs concurrently, and the replies go
back in the order they come (as Triton does). A request may have many replies (a decoupled
model streams one per piece of text). A request that fails gets a reply with its error message
on the stream, which stays open for the next request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from common.errors import MeshError
from common.llm_protocol import is_final
from protos import grpc_service_pb2 as pb

log = structlog.get_logger()

Handle = Callable[[pb.ModelInferRequest], AsyncIterator[pb.ModelInferResponse]]


def unary(
    infer: Callable[[pb.ModelInferRequest], Awaitable[pb.ModelInferResponse]],
) -> Handle:
    """A one-reply-per-request `infer` as a stream handler."""

    async def handle(request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferResponse]:
        yield await infer(request)

    return handle


async def serve(
    requests: AsyncIterator[pb.ModelInferRequest],
    handle: Handle | Callable[[pb.ModelInferRequest], Awaitable[pb.ModelInferResponse]],
    write: Callable[[pb.ModelStreamInferResponse], Awaitable[None]],
    streams: bool = False,
) -> None:
    """Write every reply of every request as it comes, until the client half-closes and
    every request has its last reply. `handle` returns an async iterator of replies when
    `streams`, else one awaitable reply. Each request's task writes its own replies (one
    write at a time on the stream): a streamed token wakes one task, not a second one to
    relay it."""
    each: Handle = handle if streams else unary(handle)  # type: ignore[assignment,arg-type]
    writing = asyncio.Lock()
    tasks: set[asyncio.Task] = set()

    async def send(reply: pb.ModelStreamInferResponse) -> None:
        async with writing:
            await write(reply)

    async def one(request: pb.ModelInferRequest) -> None:
        # A request's final reply is written once its replies are exhausted (its statistics
        # recorded), so a client holding it finds the request counted; the others at once.
        final: pb.ModelStreamInferResponse | None = None
        error: pb.ModelStreamInferResponse | None = None
        try:
            async for response in each(request):
                if final is not None:  # a reply after one flagged final keeps its order
                    await send(final)
                    final = None
                reply = pb.ModelStreamInferResponse(infer_response=response)
                if is_final(response.parameters):
                    final = reply
                else:
                    await send(reply)
        except MeshError as e:
            error = _error(request, e.message)
        except Exception as e:  # a bug: the request still gets an answer, the stream lives
            log.exception("internal_error", rpc="ModelStreamInfer")
            error = _error(request, f"internal error: {type(e).__name__}: {e}")
        for last in (final, error):
            if last is not None:
                await send(last)

    try:
        async for request in requests:
            task = asyncio.create_task(one(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
    finally:
        for task in list(tasks):
            task.cancel()


def _error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(id=request.id, model_name=request.model_name),
    )
