"""The ASGI side of the front door: read a bounded body, route, answer, watch the client.

A request's body is read to at most `max_body_bytes` (413 past it, before reading on when
Content-Length says so) within `body_timeout_s` (408: a slow-loris body; a slow header is
the protocol's, router/http/server.py). Then its handler runs while the client is watched:
a client that disconnects cancels the handler, and with it the call on the dispatch path
(the worker aborts the generation; billing keeps what was sent, as a gRPC cancel does).

Anything a handler raises becomes a JSON error in the API's own shape (errors.py); an
exception that is not an HttpError or MeshError is a bug: logged with its traceback here,
answered 500 with no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from common.errors import MeshError
from router.http.errors import HttpError

log = structlog.get_logger()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
TRANSPORT = "meshserve.transport"  # set in the scope by router/http/server.py's protocol


@dataclass
class Request:
    method: str
    path: str
    query: bytes
    headers: dict[str, str]
    body: bytes

    @property
    def openai(self) -> bool:
        """Errors in OpenAI's shape: everything but KServe's /v2 (OpenAI's routes are
        served with and without /v1, as llama-server does)."""
        return not self.path.startswith("/v2")

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


@dataclass
class Out:
    """The response side: one plain answer, or a stream of server-sent events. A write to a
    client that is gone raises ConnectionResetError (so a billed piece is taken back)."""

    send: Send
    transport: Any
    started: bool = False
    finished: bool = False  # the last byte of the answer was handed to the transport
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        return self.transport is not None and self.transport.is_closing()

    async def respond(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if self.closed:
            raise ConnectionResetError("the client went away")
        extra = [(k.encode(), v.encode()) for k, v in headers]
        self.status, self.started = status, True
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                ],
            }
        )
        self.finished = True
        await self.send({"type": "http.response.body", "body": body})

    async def start_events(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client went away")
        self.status, self.started = 200, True
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )

    async def event(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client went away")
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_events(self) -> None:
        if not self.closed and not self.finished:
            self.finished = True
            await self.send({"type": "http.response.body", "body": b""})


Handler = Callable[[Request, Out], Awaitable[None]]
Route = Callable[[Request], Handler | None]


class App:
    def __init__(self, route: Route, max_body_bytes: int, body_timeout_s: float) -> None:
        self.route = route
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        out = Out(send, scope.get(TRANSPORT))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        request = Request(scope["method"], scope["path"], scope["query_string"], headers, b"")
        try:
            request.body = await self._body(receive, headers)
            handler = self.route(request)
            if handler is None:
                raise HttpError(404, f"no endpoint {request.method} {request.path[:200]}")
            await self._watched(handler(request, out), receive, out)
        except HttpError as e:
            await self._error(out, request, e)
        except MeshError as e:
            await self._error(out, request, HttpError.of(e))
        except (ConnectionError, asyncio.CancelledError):
            return  # the client went away: nothing to answer
        except Exception:
            log.exception("http_internal_error", method=request.method, path=request.path[:200])
            await self._error(out, request, HttpError(500, "internal error (logged)"))

    async def _body(self, receive: Receive, headers: dict[str, str]) -> bytes:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise HttpError(413, f"the body is {length} bytes; the limit is {self.max_body_bytes}")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ConnectionResetError("the client went away")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise HttpError(
                            413, f"the body is over the limit of {self.max_body_bytes} bytes"
                        )
                    chunks.append(chunk)
                    if not message.get("more_body"):
                        return b"".join(chunks)
        except TimeoutError:
            raise HttpError(408, f"the body did not arrive within {self.body_timeout_s}s") from None

    async def _watched(self, work: Awaitable[None], receive: Receive, out: Out) -> None:
        """Run `work` in this task; a watcher cancels it when the client disconnects before
        the answer is complete (one task more per request, not two)."""
        me = asyncio.current_task()
        assert me is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await _disconnect(receive)
            if not out.finished:
                gone = True
                me.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await work
        except asyncio.CancelledError:
            if gone:
                raise ConnectionResetError("the client went away") from None
            raise
        finally:
            watcher.cancel()

    @staticmethod
    async def _error(out: Out, request: Request, error: HttpError) -> None:
        if out.closed:
            return
        if out.started:  # mid-stream: the error is the stream's last event
            if out.status == 200:
                body = error.openai() if request.openai else error.kserve()
                with contextlib.suppress(ConnectionError):
                    await out.event(b"data: " + body + b"\n\n")
                    await out.end_events()
            return
        body = error.openai() if request.openai else error.kserve()
        with contextlib.suppress(ConnectionError):
            await out.respond(error.status, body, headers=error.headers)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
