"""The LLM mode's two load shapes, over ModelStreamInfer (`stream`) or, with
`api="openai"`, over an OpenAI completions server's SSE (`openai`, e.g. llama.cpp's
llama-server): the same requests, recorder and load shapes drive either.

- closed loop: `concurrency` callers, each starts its next request when its last one's
  final response came; TTFT and end-to-end latency count from the send.
- open loop: Poisson arrivals at `rate` requests/s (the same schedule as the tensor mode,
  `loadtest.runner.Arrivals`), latency counted from each arrival's scheduled time, and the
  run flagged `client_limited` when the client fell behind that schedule.

A run warms up (unmeasured), starts requests until `duration` has passed or
`max_requests` were sent, then waits for those in flight (each has a deadline).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import grpc
from tokenizers import Tokenizer

from loadtest.llm import openai
from loadtest.llm.prompts import Prompt
from loadtest.llm.stats import LLMRecorder
from loadtest.llm.stream import Streams, build_request
from loadtest.runner import Arrivals, Progress, client_report, tick
from protos import grpc_service_pb2 as pb


@dataclass
class LLMLoad:
    address: str
    model: str
    prompts: list[Prompt]
    max_tokens: int
    sampling: dict = field(default_factory=dict)  # more sampling_parameters keys
    version: str = ""
    duration: float = 10.0
    warmup: float = 0.0
    timeout: float = 120.0
    max_requests: int = 10_000_000
    tokenizer: Tokenizer | None = None
    return_token_counts: bool = False  # ask Triton's vLLM backend for num_*_tokens
    progress_seconds: float = 1.0
    min_send_fraction: float = 0.95
    max_send_lag_ms: float = 50.0
    credentials: grpc.ChannelCredentials | None = None  # TLS (common.tls)
    api_key: str | None = None  # sent as `authorization: Bearer <key>` (the router's tenants)
    api: str = "triton"  # triton: ModelStreamInfer; openai: POST /v1/completions, SSE
    # server: the server's usage, else `tokenizer`; tokenizer: always `tokenizer` (stats.py)
    count_tokens: str = "server"

    def requests(self) -> list[tuple[pb.ModelInferRequest | bytes, str]]:
        """One request per prompt, built once; the run cycles through them."""
        out: list[tuple[pb.ModelInferRequest | bytes, str]] = []
        for i, prompt in enumerate(self.prompts):
            sampling = {**self.sampling, "max_tokens": prompt.max_tokens or self.max_tokens}
            if self.api == "openai":
                out.append((openai.build_request(self.model, prompt.text, sampling), prompt.text))
                continue
            request = build_request(
                self.model,
                prompt.text,
                sampling,
                self.version,
                str(i),
                self.return_token_counts,
            )
            out.append((request, prompt.text))
        return out


class _Run:
    def __init__(self, load: LLMLoad, label: str, progress: Progress | None) -> None:
        self.load, self.label, self.progress = load, label, progress
        self.recorder = LLMRecorder(load.tokenizer, load.count_tokens)
        self.requests = itertools.cycle(load.requests())
        self.streams: Streams | openai.OpenAIStreams
        if load.api == "openai":
            self.streams = openai.OpenAIStreams(load.address, load.api_key)
        else:
            self.streams = Streams(load.address, load.credentials, load.api_key)
        self.sent = self.completed = self.pieces_seen = 0
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.measure_from = self.start + load.warmup
        self.stop_at = self.measure_from + load.duration

    def refuse(self) -> None:
        self.recorder.error("CLIENT_BACKLOG")

    def count_piece(self) -> None:
        self.pieces_seen += 1

    async def send(self, due: float) -> None:
        """The next request, timed from `due`; counted if due in the measured window."""
        self.sent += 1
        request, prompt = next(self.requests)
        out = await self.streams.generate(
            request,  # type: ignore[arg-type]  # built for this wire by LLMLoad.requests
            due,
            self.load.timeout,
            self.loop.time,
            self.count_piece,
        )
        self.completed += 1
        if due >= self.measure_from:
            self.recorder.add(out, prompt)

    def line(self, now: float, pieces_per_s: float) -> str:
        phase = "warm-up" if now < self.measure_from else "measure"
        r = self.recorder
        return (
            f"{self.label} {phase} {now - self.start:5.1f}s  sent {self.sent}  "
            f"done {self.completed}  ok {r.count}  errors {sum(r.errors.values())}  "
            f"{pieces_per_s:6.1f} pieces/s  TTFT p50 {r.ttft.percentile_ms(50) or 0:.1f} ms"
        )

    async def finish(self, tasks: list[asyncio.Task], scheduled: bool = False) -> dict:
        """Wait for `tasks`; an open loop (`scheduled`) spans its whole window unless
        --max-requests ended its schedule first."""
        ticker = (
            asyncio.ensure_future(
                tick(self.progress, self.load.progress_seconds, lambda: self.pieces_seen, self.line)
            )
            if self.progress
            else None
        )
        try:
            await asyncio.gather(*tasks)
        finally:
            if ticker:
                ticker.cancel()
            await self.streams.close()
        if self.progress:
            self.progress(self.line(self.loop.time(), 0.0).replace("measure", "done   "), True)
        window_end = self.stop_at if scheduled and self.sent < self.load.max_requests else 0.0
        summary = self.recorder.summary(self.measure_from, window_end)
        return {
            **summary,
            "sent": self.sent,
            "served_in_window": self.recorder.served_until(self.stop_at),
        }


async def closed_loop(load: LLMLoad, concurrency: int, progress: Progress | None = None) -> dict:
    run = _Run(load, f"[c={concurrency}]", progress)

    async def caller() -> None:
        while (now := run.loop.time()) < run.stop_at and run.sent < load.max_requests:
            await run.send(now)

    result = await run.finish([asyncio.ensure_future(caller()) for _ in range(concurrency)])
    return {"concurrency": concurrency, **result}


async def open_loop(
    load: LLMLoad,
    rate: float,
    seed: int = 0,
    max_in_flight: int = 1_000,
    progress: Progress | None = None,
) -> dict:
    """Poisson arrivals at `rate`/s; past `max_in_flight` streams outstanding an arrival is
    not sent and counts as CLIENT_BACKLOG. `client` says whether the client kept to its
    schedule, as in the tensor mode."""
    run = _Run(load, f"[rate={rate:g}/s]", progress)
    arrivals = Arrivals(run, load, rate, seed, max_in_flight)
    result = await run.finish([asyncio.ensure_future(arrivals.drive(run.send))], scheduled=True)
    client = client_report(arrivals.lag, arrivals.unsent, load)
    return {"offered_rps": rate, **result, "client_limited": client["limited"], "client": client}
