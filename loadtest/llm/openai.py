"""One request of the OpenAI completions API (`POST /v1/completions`, `"stream": true`),
timed piece by piece from its server-sent events: the LLM mode's second wire, for servers
that speak OpenAI's API (llama.cpp's llama-server, vLLM's, TGI's). It returns the same
Outcome as the ModelStreamInfer client (loadtest/llm/stream.py), so one recorder and one
load shape drive either server.

Plain HTTP/1.1 on asyncio streams (one connection a request, `Connection: close`), chunked
or not; a `usage` object in the last event gives the server's own token counts, as
llama-server sends with `stream_options.include_usage`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

from loadtest.llm.stream import Outcome

PATH = "/v1/completions"


def build_request(model: str, text: str, sampling: dict) -> bytes:
    """The JSON body: the prompt, the sampling keys (OpenAI's names: max_tokens,
    temperature, top_p, stop, seed; a server's own extras pass through), streamed."""
    body = {
        "model": model,
        "prompt": text,
        **sampling,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


class OpenAIStreams:
    """The server every request connects to (http://host:port)."""

    def __init__(self, address: str, api_key: str | None = None) -> None:
        url = urlsplit(address if "://" in address else f"http://{address}")
        if url.scheme != "http" or url.hostname is None:
            raise ValueError(f"{address!r}: expected http://HOST:PORT (plain HTTP)")
        self.host, self.port = url.hostname, url.port or 80
        self.api_key = api_key

    async def close(self) -> None:
        return None

    async def generate(
        self,
        request: bytes,
        start: float,
        timeout: float,
        clock: Callable[[], float],
        on_piece: Callable[[], None] = lambda: None,
    ) -> Outcome:
        out = Outcome(start)
        try:
            await asyncio.wait_for(self._stream(request, out, clock, on_piece), timeout)
        except TimeoutError:
            out.error = "DEADLINE_EXCEEDED"
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            out.error = f"stream: {type(e).__name__}"
        except HTTPError as e:
            out.error = f"HTTP {e.status}"
            out.shed, out.retry_after = e.status == 429, e.retry_after
        finally:
            out.end = clock()
        return out

    async def _stream(
        self, body: bytes, out: Outcome, clock: Callable[[], float], on_piece: Callable[[], None]
    ) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        try:
            writer.write(
                f"POST {PATH} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n".encode()
                + f"Content-Type: application/json\r\n{auth}".encode()
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            async for event in events(reader):
                if event == "[DONE]":
                    return
                _record(out, json.loads(event), clock(), on_piece)
            if out.finish_reason is None:
                out.error = "stream: ended before the last event"
        finally:
            writer.close()


class HTTPError(Exception):
    def __init__(self, status: int, retry_after: str | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.retry_after = retry_after  # its Retry-After header


def _record(out: Outcome, chunk: dict, now: float, on_piece: Callable[[], None]) -> None:
    choice = (chunk.get("choices") or [{}])[0]
    text = choice.get("text") or ""
    if text:
        out.pieces.append(now)
        out.text += text
        on_piece()
    if choice.get("finish_reason"):
        out.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        out.prompt_tokens = usage.get("prompt_tokens")
        out.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            out.cached_tokens = int(details["cached_tokens"])


async def events(reader: asyncio.StreamReader) -> AsyncIterator[str]:
    """The `data:` payloads of an HTTP/1.1 response, chunked or not."""
    status = (await reader.readline()).decode()
    headers = {}
    while (line := (await reader.readline()).decode().strip()) != "":
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip().lower()
    parts = status.split()
    if len(parts) < 2 or parts[1] != "200":
        code = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        raise HTTPError(code, headers.get("retry-after"))
    chunked = headers.get("transfer-encoding") == "chunked"
    buffer = b""
    while True:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            buffer += (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                return
            buffer += data
        buffer = buffer.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.decode().splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()
