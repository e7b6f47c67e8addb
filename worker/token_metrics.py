"""The worker's metrics registry and the LLM token-timing histograms (time to first token,
inter-token latency), observed as an LLM's pieces leave the engine (worker/llm/serving.py).
The rest of the worker's series are read at scrape time (worker/metrics.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram

from common.llm_protocol import TOKEN_BUCKETS

# One registry per process, not prometheus_client's global one: a worker exposes its own
# series only (no process_/python_ collectors from imported libraries' defaults).
REGISTRY = CollectorRegistry()

TTFT = Histogram(
    "meshserve_worker_time_to_first_token_seconds",
    "From a request's admission to the engine to its first generated token",
    ["model"],
    buckets=TOKEN_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN = Histogram(
    "meshserve_worker_inter_token_seconds",
    "Between a stream's pieces, per token they carry",
    ["model"],
    buckets=TOKEN_BUCKETS,
    registry=REGISTRY,
)


@dataclass
class TokenClock:
    """One generation's timing: feed it each output's running completion-token count."""

    model: str
    started: float = field(default_factory=time.perf_counter)
    last: float | None = None
    tokens: int = 0

    def observe(self, completion_tokens: int) -> int:
        """The tokens new since the last call."""
        new = completion_tokens - self.tokens
        if new <= 0:
            return 0
        now = time.perf_counter()
        if self.last is None:
            TTFT.labels(self.model).observe(now - self.started)
        else:
            INTER_TOKEN.labels(self.model).observe((now - self.last) / new)
        self.last, self.tokens = now, completion_tokens
        return new
