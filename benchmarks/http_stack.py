"""Which HTTP server the router's front door runs on: uvicorn+httptools or aiohttp, measured.

    flock /tmp/meshserve-bench.lock python -m benchmarks.http_stack [--rounds 3]

Each stack serves the same endpoint in its own process, in one asyncio event loop as the
router would run it: POST a ~1 KB JSON body, parse it, answer a ~1 KB JSON body. The client
(this process) holds keep-alive HTTP/1.1 connections written with asyncio streams, so it is
the same client for both. Measured per stack and round: p50 latency at 1 connection and
requests/s at 32 connections; the installed size of each stack's distributions is read from
this environment. Writes benchmarks/results/http_stack.json; the verdict picks the faster
stack at 32 connections unless it loses at 1 caller by more than 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata as md
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import figure, http_exchange, machine, parse, write_result
from common.net import free_port

BODY = json.dumps({"inputs": [{"name": "x", "data": list(range(200))}]}).encode()
STACKS = {
    "uvicorn+httptools": ["uvicorn", "httptools", "h11", "click"],
    "aiohttp": [
        "aiohttp",
        "multidict",
        "yarl",
        "propcache",
        "frozenlist",
        "aiosignal",
        "aiohappyeyeballs",
        "attrs",
    ],
}


async def _answer(body: bytes) -> bytes:
    doc = json.loads(body)
    return json.dumps({"outputs": doc["inputs"], "model_name": "echo"}).encode()


def serve_uvicorn(port: int) -> None:
    import uvicorn

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        out = await _answer(b"".join(chunks))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(out)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="asyncio",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )
    asyncio.run(uvicorn.Server(config).serve())


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        out = await _answer(await request.read())
        return web.Response(body=out, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/echo", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


async def _connection(port: int, count: int, latencies: list[float], stop_at: float) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        b"POST /echo HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    )
    try:
        for _ in range(count):
            if time.monotonic() > stop_at:
                break
            latencies.append(await http_exchange(reader, writer, request))
    finally:
        writer.close()


async def load(port: int, connections: int, per_connection: int) -> tuple[float, float]:
    """(p50 seconds, requests per second) over `connections` keep-alive connections."""
    latencies: list[float] = []
    stop_at = time.monotonic() + 60
    await asyncio.gather(*(_connection(port, 20, [], stop_at) for _ in range(connections)))
    t0 = time.perf_counter()
    await asyncio.gather(
        *(_connection(port, per_connection, latencies, stop_at) for _ in range(connections))
    )
    elapsed = time.perf_counter() - t0
    return statistics.median(latencies), len(latencies) / elapsed


def _wait_port(port: int, timeout: float = 20) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def installed_mb(dists: list[str]) -> float:
    total = 0
    for name in dists:
        try:
            files = md.distribution(name).files or []
        except md.PackageNotFoundError:
            continue
        for f in files:
            path = Path(str(f.locate()))
            if path.is_file():
                total += path.stat().st_size
    return round(total / 1e6, 2)


def measure(rounds: int) -> dict:
    """Both stacks up at once, measured in alternating rounds (the shared machine's load
    drifts; alternating spreads it over both)."""
    ports = {stack: free_port() for stack in STACKS}
    servers = []
    for stack, port in ports.items():
        target = "serve_uvicorn" if stack.startswith("uvicorn") else "serve_aiohttp"
        code = f"from benchmarks.http_stack import {target}; {target}({port})"
        servers.append(subprocess.Popen([sys.executable, "-c", code]))
    p50s: dict[str, list[float]] = {s: [] for s in STACKS}
    rates: dict[str, list[float]] = {s: [] for s in STACKS}
    try:
        for port in ports.values():
            _wait_port(port)
        for _ in range(rounds):
            for stack, port in ports.items():
                p50, _ = asyncio.run(load(port, 1, 2000))
                _, rate = asyncio.run(load(port, 32, 200))
                p50s[stack].append(p50 * 1000)
                rates[stack].append(rate)
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)
    return {
        stack: {
            "p50_ms_1_caller": round(statistics.median(p50s[stack]), 4),
            "rps_32_callers": round(statistics.median(rates[stack]), 1),
            "rounds_p50_ms": [round(x, 4) for x in p50s[stack]],
            "rounds_rps": [round(x, 1) for x in rates[stack]],
            "installed_mb": installed_mb(STACKS[stack]),
        }
        for stack in STACKS
    }


def verdict(results: dict) -> str:
    u, a = results["uvicorn+httptools"], results["aiohttp"]
    faster = "uvicorn+httptools" if u["rps_32_callers"] >= a["rps_32_callers"] else "aiohttp"
    other = "aiohttp" if faster == "uvicorn+httptools" else "uvicorn+httptools"
    f, o = results[faster], results[other]
    if f["p50_ms_1_caller"] > 1.1 * o["p50_ms_1_caller"]:
        faster, other = other, faster
    w, lo = results[faster], results[other]
    return (
        f"{faster}: {w['rps_32_callers']:.0f} req/s at 32 connections vs "
        f"{lo['rps_32_callers']:.0f} "
        f"({w['rps_32_callers'] / lo['rps_32_callers']:.2f}x), p50 {w['p50_ms_1_caller']:.3f} ms "
        f"vs {lo['p50_ms_1_caller']:.3f} ms at 1 connection, {w['installed_mb']} MB installed vs "
        f"{lo['installed_mb']} MB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http_stack")
    parser.add_argument("--rounds", type=int, default=5)
    args = parse(parser, argv, rounds=1)
    results = measure(args.rounds)
    payload = {
        "machine": machine(),
        "note": "2-core VM shared with other agents' builds and tests while it ran",
        "what": "one JSON POST echo endpoint per stack, its own process, keep-alive client",
        "results": results,
        "verdict": verdict(results),
    }
    path = write_result("http_stack", payload, TITLE, rows(payload), args.quick)
    print(json.dumps(payload["results"], indent=2))
    print(payload["verdict"])
    print(f"wrote {path}")
    return 0


TITLE = "The router's HTTP server, chosen by measurement (JSON echo per stack)"


def rows(r: dict) -> list[list]:
    """Per stack: p50 at 1 connection, req/s at 32, MB installed; and the one chosen."""
    out = [
        figure(
            f"{stack}: p50 1 conn / req/s 32 conns / MB",
            f"{v['p50_ms_1_caller']:.3f} ms / {v['rps_32_callers']:.0f} / {v['installed_mb']}",
        )
        for stack, v in r["results"].items()
    ]
    return [*out, figure("chosen", r["verdict"].split(":")[0])]


if __name__ == "__main__":
    sys.exit(main())
