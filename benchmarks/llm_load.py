"""What benchmarks/llm.py sends and how it times it: prompts, token counting, one streamed
request to llama.cpp's OpenAI-compatible server or to a meshserve worker, and N concurrent
streams.

Every stream is timed the same way on every system: TTFT = first non-empty piece of text;
inter-token latency = (last piece - first piece) / (completion tokens - 1); tokens are
counted by re-tokenizing the returned text with SmolLM2's tokenizer (rebuilt from the GGUF),
never trusted from a server's own usage field.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

# Text that ships with Python itself: the docstrings of these stdlib modules, in this
# order (about 18,000 SmolLM2 tokens on Python 3.11). Prompts are windows of it that start
# at different offsets, so no two requests share a prefix a server could cache.
CORPUS_MODULES = (
    "argparse",
    "collections",
    "json",
    "logging",
    "subprocess",
    "threading",
    "textwrap",
    "itertools",
    "contextlib",
    "dataclasses",
    "functools",
    "heapq",
)


def corpus() -> str:
    parts = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or getattr(value, "__module__", "") != name:
                continue
            if inspect.isfunction(value) or inspect.isclass(value):
                parts.append(inspect.getdoc(value) or "")
    return "\n\n".join(p for p in parts if p)


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # counted with SmolLM2's tokenizer


class Prompts:
    """Prompts of about `length` tokens, a different window of the corpus each call."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(corpus()).ids
        self.calls = 0

    def make(self, length: int) -> Prompt:
        span = len(self.ids) - length
        if span <= 0:
            raise ValueError(f"corpus has {len(self.ids)} tokens; cannot cut {length}")
        start = (self.calls * 1_009) % span
        self.calls += 1
        text = self.tokenizer.decode(self.ids[start : start + length])
        return Prompt(text, self.count(text))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)


@dataclass
class Stream:
    """One streamed generation, timed from the moment the request was sent."""

    prompt_tokens: int
    text: str = ""
    ttft_s: float | None = None
    last_s: float | None = None
    pieces: int = 0
    completion_tokens: int = 0
    usage: dict = field(default_factory=dict)  # what the server said, for the record
    error: str | None = None

    def itl_s(self) -> float | None:
        if self.ttft_s is None or self.last_s is None or self.completion_tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.completion_tokens - 1)


Send = Callable[[Prompt, int], AsyncIterator[tuple[str, dict]]]
"""(prompt, max_tokens) -> pieces of text as they arrive, each with the response's
parameters (usage arrives with the last)."""


async def timed(send: Send, prompt: Prompt, max_tokens: int, tokenizer: Tokenizer) -> Stream:
    s = Stream(prompt.tokens)
    start = time.perf_counter()
    try:
        async for piece, params in send(prompt, max_tokens):
            now = time.perf_counter() - start
            s.usage.update(params)
            if not piece:
                continue
            if s.ttft_s is None:
                s.ttft_s = now
            s.last_s = now
            s.text += piece
            s.pieces += 1
    except Exception as e:  # a failed stream is counted, not fatal
        s.error = f"{type(e).__name__}: {e}"[:300]
    s.completion_tokens = len(tokenizer.encode(s.text).ids) if s.text else 0
    return s


def pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if len(values) else None


async def concurrent(
    send: Send,
    prompts: Prompts,
    lengths: Sequence[int],
    streams: int,
    requests_per_stream: int,
    max_tokens: int,
    deadline_s: float,
) -> dict:
    """`streams` closed-loop callers, caller i sending prompts of lengths[(i + j) % n] one
    after another; aggregate output tokens/s = all completion tokens / wall time."""
    tokenizer = prompts.tokenizer
    plan = [
        [prompts.make(lengths[(i + j) % len(lengths)]) for j in range(requests_per_stream)]
        for i in range(streams)
    ]
    done: list[Stream] = []
    start = time.perf_counter()

    async def caller(mine: list[Prompt]) -> None:
        for p in mine:
            if time.perf_counter() - start > deadline_s:
                return
            done.append(await timed(send, p, max_tokens, tokenizer))

    await asyncio.gather(*(caller(mine) for mine in plan))
    wall = time.perf_counter() - start
    return summarize(done, wall, streams)


def summarize(done: list[Stream], wall_s: float, streams: int) -> dict:
    ok = [s for s in done if s.error is None and s.ttft_s is not None]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    itl = [v for s in ok if (v := s.itl_s()) is not None]
    out_tokens = sum(s.completion_tokens for s in ok)
    return {
        "streams": streams,
        "requests": len(done),
        "errors": len(done) - len(ok),
        "first_error": next((s.error for s in done if s.error), None),
        "wall_s": round(wall_s, 2),
        "prompt_tokens": [s.prompt_tokens for s in done],
        "completion_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall_s, 1) if wall_s else None,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "server_usage_example": ok[0].usage if ok else {},
    }


async def single(send: Send, prompt: Prompt, max_tokens: int, tokenizer: Tokenizer) -> dict:
    """One stream alone: decode tokens/s after the first token, and prompt tokens/s
    (prompt tokens / TTFT, which includes one decode step and the transport)."""
    s = await timed(send, prompt, max_tokens, tokenizer)
    itl = s.itl_s()
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "ttft_ms": round(s.ttft_s * 1000, 1) if s.ttft_s is not None else None,
        "itl_ms": round(itl * 1000, 2) if itl else None,
        "decode_tokens_per_s": round(1 / itl, 1) if itl else None,
        "prompt_tokens_per_s": round(s.prompt_tokens / s.ttft_s, 1) if s.ttft_s else None,
        "error": s.error,
    }


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(float(np.median(values)), 1) if values else None


# ---- llama.cpp's OpenAI-compatible server: /v1/completions, server-sent events -----------


def openai_sender(
    host: str, port: int, extra: dict | None = None, timeout_s: float = 300.0
) -> Send:
    async def send(prompt: Prompt, max_tokens: int) -> AsyncIterator[tuple[str, dict]]:
        body = json.dumps(
            {
                "prompt": prompt.text,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                **(extra or {}),
            }
        ).encode()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\n"
                + f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            async for event in _sse(reader, timeout_s):
                if event == "[DONE]":
                    return
                chunk = json.loads(event)
                choice = (chunk.get("choices") or [{}])[0]
                params = {"finish_reason": choice.get("finish_reason")}
                if chunk.get("usage"):
                    params.update(chunk["usage"])
                yield choice.get("text") or "", params
        finally:
            writer.close()

    return send


async def _sse(reader: asyncio.StreamReader, timeout_s: float) -> AsyncIterator[str]:
    """The `data:` payloads of an HTTP/1.1 response, chunked or not."""
    status = (await asyncio.wait_for(reader.readline(), timeout_s)).decode()
    headers = {}
    while (line := (await asyncio.wait_for(reader.readline(), timeout_s)).decode().strip()) != "":
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip().lower()
    if " 200 " not in status:
        raise RuntimeError(f"HTTP {status.strip()}: {(await reader.read(500)).decode()!r}")
    chunked = headers.get("transfer-encoding") == "chunked"
    buffer = b""
    while True:
        if chunked:
            size = int((await asyncio.wait_for(reader.readline(), timeout_s)).strip(), 16)
            if size == 0:
                return
            data = await asyncio.wait_for(reader.readexactly(size + 2), timeout_s)
            buffer += data[:-2]
        else:
            data = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not data:
                return
            buffer += data
        while b"\n\n" in buffer or b"\r\n\r\n" in buffer:
            sep = b"\r\n\r\n" if b"\r\n\r\n" in buffer else b"\n\n"
            event, buffer = buffer.split(sep, 1)
            for line in event.decode().splitlines():
                if line.startswith("data:"):
                    yield line[5:].strip()


async def wait_http(host: str, port: int, path: str, timeout_s: float, alive: Callable) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited while starting")
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"http://{host}:{port}{path} not ready after {timeout_s}s")
