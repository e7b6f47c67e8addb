"""The front door's server: uvicorn with httptools, in the router's own event loop.

uvicorn is chosen over aiohttp by benchmarks/http_stack.py (faster at 32 connections and a
quarter of the size installed). It runs as a library here: the router's process, loop and
signal handling stay the router's (`Server.startup` / `shutdown`, not `serve`, which would
take SIGTERM for itself). The socket is the router's too: SO_REUSEPORT when the router's
processes share the port, as the gRPC port does.

Slow clients: a request whose headers have not all arrived within `header_timeout_s` of
its first byte (or of the connection, or of the previous response) is answered 408 and its
connection closed, so slow-loris clients cannot hold connections open; a slow body is the
app's (router/http/app.py, 408 as well); an idle keep-alive connection is closed after
`timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.http.app import TRANSPORT, App

log = logging.getLogger("uvicorn.error")


class _Protocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        timer = self._header_timer
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def on_headers_complete(self) -> None:
        self._disarm()
        scope: dict = self.scope  # type: ignore[assignment]
        scope[TRANSPORT] = self.transport
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._disarm()
            self._arm()  # the next request's headers get the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered: its headers did arrive
        if not self.transport.is_closing():
            body = b"the request's headers did not arrive in time"
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                b"connection: close\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            self.transport.close()


class HttpServer:
    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        reuse_port: bool = False,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        header_timeout_s: float = 10.0,
        keep_alive_s: float = 30.0,
    ) -> None:
        protocol = type("Protocol", (_Protocol,), {"header_timeout_s": header_timeout_s})
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=protocol,
            loop="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            proxy_headers=False,  # no X-Forwarded-* is trusted (and one middleware less)
            date_header=False,
            timeout_keep_alive=int(keep_alive_s),
            ssl_certfile=str(tls_cert) if tls_cert else None,
            ssl_keyfile=str(tls_key) if tls_key else None,
        )
        self.host, self.port, self.reuse_port = host, port, reuse_port
        self.server = uvicorn.Server(self.config)
        self.sock: socket.socket | None = None

    async def start(self) -> int:
        """Bind and serve; the port it serves on (useful with port 0)."""
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP
        # (with proto 0 every response's body waited out the client's delayed ACK: 40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        sock.setblocking(False)
        self.sock = sock
        await self.server.startup(sockets=[sock])
        return int(sock.getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; let calls in flight end within `grace_s`, then close the rest."""
        self.server.should_exit = True
        for s in getattr(self.server, "servers", []):
            s.close()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.server.server_state.tasks and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self.server.force_exit = True
        await self.server.shutdown()
