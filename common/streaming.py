"""ModelStreamInfer on both servers: every request on a stream runs concurrently, and the
replies go back in the order they finish (as Triton does)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def concurrently(
    requests: AsyncIterator[Req], handle: Callable[[Req], Awaitable[Resp]]
) -> AsyncIterator[Resp]:
    """Yield handle(request) for each request as each completes; `handle` must not raise."""
    out: asyncio.Queue[Resp | None] = asyncio.Queue()
    tasks: set[asyncio.Task] = set()

    async def one(request: Req) -> None:
        await out.put(await handle(request))

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
