"""ModelStreamInfer on both servers: every request on a stream runs concurrently, and the
replies go back in the order they finish (as Triton does). A request that fails gets a
reply with its error message on the stream, which stays open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from common.errors import MeshError
from protos import grpc_service_pb2 as pb


async def serve(
    requests: AsyncIterator[pb.ModelInferRequest],
    infer: Callable[[pb.ModelInferRequest], Awaitable[pb.ModelInferResponse]],
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """Yield a stream reply for each request as its `infer` completes."""
    out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
    tasks: set[asyncio.Task] = set()

    async def one(request: pb.ModelInferRequest) -> None:
        try:
            reply = pb.ModelStreamInferResponse(infer_response=await infer(request))
        except MeshError as e:
            reply = pb.ModelStreamInferResponse(
                error_message=e.message,
                infer_response=pb.ModelInferResponse(id=request.id, model_name=request.model_name),
            )
        await out.put(reply)

    async def read() -> None:
        async for request in requests:
            task = asyncio.create_task(one(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
        await out.put(None)

    reader = asyncio.create_task(read())
    try:
        while (item := await out.get()) is not None:
            yield item
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()
