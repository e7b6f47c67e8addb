"""The LLM mode's OpenAI SSE wire (loadtest/llm/openai.py) against an HTTP server on
127.0.0.1 that answers as llama-server does: chunked server-sent events, one text piece an
event, `usage` in the last one, `[DONE]`; and an HTTP error. The benchmark
(benchmarks/llm_serve.py) drives the real llama-server with it."""

from __future__ import annotations

import asyncio
import json

from loadtest.llm.openai import OpenAIStreams, build_request
from loadtest.llm.prompts import Prompt
from loadtest.llm.runner import LLMLoad, closed_loop


async def serve(seen: list[dict]) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(
            next(h for h in head.split("\r\n") if h.lower().startswith("content-length")).split(
                ":"
            )[1]
        )
        body = json.loads(await reader.readexactly(length))
        seen.append(body)
        if body["prompt"] == "bad":
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        events = [{"choices": [{"text": w, "finish_reason": None}]} for w in ("a", " b", " c")]
        events.append({"choices": [{"text": "", "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
        for event in [*(json.dumps(e) for e in events), "[DONE]"]:
            data = f"data: {event}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_one_request_is_timed_piece_by_piece_with_the_servers_counts() -> None:
    async def main() -> None:
        seen: list[dict] = []
        server, port = await serve(seen)
        async with server:
            streams = OpenAIStreams(f"127.0.0.1:{port}")
            loop = asyncio.get_running_loop()
            body = build_request("m", "hello", {"max_tokens": 3, "temperature": 0})
            out = await streams.generate(body, loop.time(), 10.0, loop.time)
            assert out.error is None
            assert out.text == "a b c" and len(out.pieces) == 3
            assert out.pieces == sorted(out.pieces) and out.pieces[-1] - out.pieces[0] > 0.015
            assert (out.prompt_tokens, out.completion_tokens) == (5, 3)
            assert out.finish_reason == "length"
            assert seen[0]["stream"] is True and seen[0]["max_tokens"] == 3
            bad = await streams.generate(
                build_request("m", "bad", {}), loop.time(), 10.0, loop.time
            )
            assert bad.error == "HTTP 400"

    asyncio.run(main())


def test_the_closed_loop_drives_the_openai_wire() -> None:
    async def main() -> dict:
        server, port = await serve([])
        async with server:
            load = LLMLoad(
                f"http://127.0.0.1:{port}",
                "m",
                [Prompt("x"), Prompt("bad")],
                3,
                duration=30,
                max_requests=4,
                api="openai",
            )
            return await closed_loop(load, 2)

    result = asyncio.run(main())
    assert result["requests"] == 2 and result["errors"] == {"HTTP 400": 2}
    assert result["output_tokens"] == 6 and result["token_source"] == {"server": 2}
    assert 5 < result["itl_ms"]["p50"] < 1000  # the server paces its pieces 10 ms apart
