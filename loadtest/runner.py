"""The two load shapes, on one grpc.aio channel (or `connections` channels, each its own TCP
connection, the callers spread over them), sending pre-serialized requests.

- closed loop: `concurrency` callers, each sends its next request when the last returns.
  Throughput at a given concurrency; latency as a caller that waits sees it.
- open loop: Poisson arrivals at `rate` per second, each sent whether or not earlier ones
  returned. Latency counts from the arrival's scheduled time, not from when the client got
  round to sending it, so a stalled client or server cannot hide queueing (no coordinated
  omission). The client itself can fall behind that schedule (a rate beyond what this
  machine can send): then the run is flagged `client_limited` — its throughput and latency
  describe the client, not the server — with the send lag and the fraction of the measured
  window's arrivals the client reached. Arrivals still unreached once the window (plus the
  lag allowance) has passed are never sent, so such a run ends on time.

Both warm up first (not measured), stop starting requests after `duration` (or at
`max_requests`), wait for those in flight (each has a deadline), and count what started in
the measured window. Responses are not decoded: the caller measures the server.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from common import tls
from common.rpc import message_options
from loadtest.stats import Recorder

METHOD = "/inference.GRPCInferenceService/ModelInfer"
Progress = Callable[[str, bool], None]  # (line, final)


@dataclass
class Load:
    address: str
    requests: list[bytes]  # serialized ModelInferRequests, cycled through
    duration: float = 10.0
    warmup: float = 1.0
    timeout: float = 30.0
    max_requests: int = 10_000_000
    progress_seconds: float = 1.0
    # Open loop: the client is "limited" when it reached under this fraction of the measured
    # window's scheduled arrivals, or when its send lag (actual send time - scheduled time)
    # has a p99 above max_send_lag_ms.
    min_send_fraction: float = 0.95
    max_send_lag_ms: float = 50.0
    credentials: grpc.ChannelCredentials | None = None  # TLS (common.tls)
    metadata: tuple[tuple[str, str], ...] = ()  # sent with every call: an API key
    # TCP connections the calls are spread over: a server of several processes sharing one
    # port (SO_REUSEPORT) gets each connection on one process.
    connections: int = 1
    channel_options: tuple[tuple[str, str | int], ...] = ()  # e.g. a client-side lb policy


class _Run:
    """State one run shares with its progress line."""

    def __init__(self, load: Load, label: str, progress: Progress | None) -> None:
        self.load, self.label, self.progress = load, label, progress
        self.recorder = Recorder()
        self.sent = 0
        self.completed = 0  # including warm-up, for the live rate
        # A local subchannel pool each: channels to one address otherwise share a connection.
        options = [*message_options(), *load.channel_options]
        if load.connections > 1:
            options.append(("grpc.use_local_subchannel_pool", 1))
        self.channels = [
            tls.aio_channel(load.address, load.credentials, options)
            for _ in range(max(1, load.connections))
        ]
        self.calls = [channel.unary_unary(METHOD) for channel in self.channels]
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.measure_from = self.start + load.warmup
        self.stop_at = self.measure_from + load.duration

    def refuse(self) -> None:
        self.recorder.error("CLIENT_BACKLOG")

    def body(self) -> bytes:
        self.sent += 1
        return self.load.requests[self.sent % len(self.load.requests)]

    async def send(self, body: bytes, started: float, t0: float) -> None:
        """One call; latency from t0 (loop clock), counted if it started in the window."""
        try:
            await self.calls[self.sent % len(self.calls)](
                body, timeout=self.load.timeout, metadata=self.load.metadata or None
            )
        except grpc.aio.AioRpcError as e:
            if started >= self.measure_from:
                self.recorder.error(e.code().name)
            return
        finally:
            self.completed += 1
        if started >= self.measure_from:
            self.recorder.ok(self.loop.time() - t0)

    def line(self, now: float, rate: float) -> str:
        phase = "warm-up" if now < self.measure_from else "measure"
        r = self.recorder
        return (
            f"{self.label} {phase} {now - self.start:5.1f}/"
            f"{self.load.warmup + self.load.duration:.0f}s  sent {self.sent}  ok {r.count}  "
            f"errors {sum(r.errors.values())}  {rate:7.0f} req/s  "
            f"p50 {r.percentile_ms(50) or 0:.2f} ms  p99 {r.percentile_ms(99) or 0:.2f} ms"
        )

    async def finish(self, workers: list[asyncio.Task]) -> dict:
        ticker = (
            asyncio.ensure_future(
                tick(self.progress, self.load.progress_seconds, lambda: self.completed, self.line)
            )
            if self.progress
            else None
        )
        try:
            await asyncio.gather(*workers)
        finally:
            if ticker:
                ticker.cancel()
            for channel in self.channels:
                await channel.close()
        seconds = min(self.load.duration, max(1e-9, self.loop.time() - self.measure_from))
        if self.progress:
            rate = self.recorder.count / seconds
            self.progress(self.line(self.loop.time(), rate).replace("measure", "done   "), True)
        out = self.recorder.summary(seconds)
        out.update(seconds=round(seconds, 3), sent=self.sent, cdf=self.recorder.cdf())
        return out


async def closed_loop(load: Load, concurrency: int, progress: Progress | None = None) -> dict:
    run = _Run(load, f"[c={concurrency}]", progress)

    async def caller() -> None:
        while (now := run.loop.time()) < run.stop_at and run.sent < load.max_requests:
            await run.send(run.body(), now, now)

    result = await run.finish([asyncio.ensure_future(caller()) for _ in range(concurrency)])
    return {"concurrency": concurrency, **result}


async def open_loop(
    load: Load,
    rate: float,
    seed: int = 0,
    max_in_flight: int = 20_000,
    progress: Progress | None = None,
) -> dict:
    """Arrivals beyond `max_in_flight` outstanding are not sent; they count as the error
    CLIENT_BACKLOG (the offered load is far past what the server answers). The result's
    `client` entry says whether the client kept to its schedule (see `client_report`)."""
    run = _Run(load, f"[rate={rate:g}/s]", progress)
    arrivals = Arrivals(run, load, rate, seed, max_in_flight)

    async def launch(t: float) -> None:
        await run.send(run.body(), t, t)

    result = await run.finish([asyncio.ensure_future(arrivals.drive(launch))])
    client = client_report(arrivals.lag, arrivals.unsent, load)
    result["client_limited"] = client["limited"]
    return {"offered_rps": rate, **result, "client": client}


class Scheduled(Protocol):
    """What an open loop reads of a run: its clock and window, and how many it sent."""

    loop: asyncio.AbstractEventLoop
    start: float
    measure_from: float
    stop_at: float
    sent: int

    def refuse(self) -> None: ...  # an arrival past max_in_flight outstanding


class Limits(Protocol):
    """A load's bounds that an open loop and its client report read."""

    max_requests: int
    max_send_lag_ms: float
    min_send_fraction: float


class Arrivals:
    """Poisson arrivals at `rate` over a run's window, each launched at its scheduled time
    `t` as `launch(t)`, which counts itself in `run.sent`. Afterwards `lag` holds the send
    lag of the measured window's arrivals and `unsent` those never reached."""

    def __init__(
        self, run: Scheduled, limits: Limits, rate: float, seed: int, max_in_flight: int
    ) -> None:
        self.run, self.rate, self.max_in_flight = run, rate, max_in_flight
        self.max_requests = limits.max_requests
        self.give_up_at = run.stop_at + limits.max_send_lag_ms / 1000
        self.rng = np.random.default_rng(seed)
        self.lag = Recorder()  # actual - scheduled send time
        self.unsent = 0

    async def drive(self, launch: Callable[[float], Awaitable[None]]) -> None:
        run, rng, rate = self.run, self.rng, self.rate
        in_flight: set[asyncio.Task] = set()
        t = run.start
        while run.sent < self.max_requests:
            t += float(rng.exponential(1.0 / rate))
            if t >= run.stop_at:
                break
            now = run.loop.time()
            if now >= self.give_up_at:  # far behind: what is left of the window stays unsent
                left_from = max(t, run.measure_from)
                self.unsent = int(t >= run.measure_from) + int(
                    rng.poisson(rate * (run.stop_at - left_from))
                )
                break
            await asyncio.sleep(max(0.0, t - now))
            if t >= run.measure_from:
                self.lag.ok(run.loop.time() - t)
            if len(in_flight) >= self.max_in_flight:
                if t >= run.measure_from:
                    run.refuse()
                continue
            task = asyncio.ensure_future(launch(t))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)


def client_report(lag: Recorder, unsent: int, load: Limits) -> dict:
    """Did the client keep to its schedule in the measured window? `reached` arrivals are
    the ones it got round to before the window closed (sent, or refused as CLIENT_BACKLOG,
    which is the server falling behind), each with its lag; `unsent` ones it never reached."""
    handled = lag.count
    scheduled = handled + unsent
    fraction = handled / scheduled if scheduled else 1.0
    lag_p99 = lag.percentile_ms(99) or 0.0
    reasons = []
    if fraction < load.min_send_fraction:
        reasons.append(
            f"reached {fraction:.1%} of the {scheduled:,} scheduled arrivals "
            f"(below {load.min_send_fraction:.0%})"
        )
    if lag_p99 > load.max_send_lag_ms:
        reasons.append(f"send lag p99 {lag_p99:g} ms (above {load.max_send_lag_ms:g} ms)")
    return {
        "limited": bool(reasons),
        "reason": "; ".join(reasons),
        "scheduled": scheduled,
        "reached": handled,
        "unsent": unsent,
        "reached_fraction": round(fraction, 4),
        "send_lag_p50_ms": lag.percentile_ms(50) or 0.0,
        "send_lag_p99_ms": lag_p99,
        "send_lag_max_ms": lag.summary(1)["max_ms"] or 0.0,
    }


async def tick(
    progress: Progress,
    every_s: float,
    count: Callable[[], int],
    line: Callable[[float, float], str],
) -> None:
    """A run's live progress (both modes): every `every_s`, `line(now, rate)` with the
    rate per second `count` grew at since the last line, until cancelled."""
    loop = asyncio.get_running_loop()
    last, last_time = count(), loop.time()
    while True:
        await asyncio.sleep(every_s)
        now, seen = loop.time(), count()
        rate = (seen - last) / max(1e-9, now - last_time)
        last, last_time = seen, now
        progress(line(now, rate), False)


def progress_printer(stream=sys.stderr):  # type: ignore[no-untyped-def]
    """A Progress that redraws one line on a terminal, else writes a line a tick."""
    live = stream.isatty()

    def show(line: str, final: bool) -> None:
        stream.write(("\r\033[K" + line + ("\n" if final else "")) if live else line + "\n")
        stream.flush()

    return show


def measured(result: dict) -> dict:
    """The result without its CDF points (for tables)."""
    return {k: v for k, v in result.items() if k != "cdf"}


def elapsed_bound(load: Load) -> float:
    """Upper bound on one run's wall time: warm-up, duration, then the last deadlines."""
    return load.warmup + load.duration + load.timeout


__all__ = [
    "Arrivals",
    "Load",
    "client_report",
    "closed_loop",
    "elapsed_bound",
    "measured",
    "open_loop",
    "progress_printer",
]
