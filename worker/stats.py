"""Per model-version counters with the meaning of Triton's ModelStatistics fields."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class BatchDurations:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class Work:
    """Sums over one kind of run (call, prefill, decode) from which its FLOPs and bytes
    follow: the model's analysis is linear in them (worker/roofline.py)."""

    runs: int = 0
    rows: int = 0
    tokens: int = 0
    tokens_sq: int = 0  # a prefill's attention grows with its tokens squared
    row_context: int = 0  # cached tokens summed over a decode run's rows
    ns: int = 0


@dataclass
class ModelStats:
    last_inference_ms: int = 0
    inference_count: int = 0  # requests' batch rows served by executions
    execution_count: int = 0  # session runs
    success: Duration = field(default_factory=Duration)  # end-to-end, per request
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchDurations] = field(default_factory=lambda: defaultdict(BatchDurations))
    work: dict[str, Work] = field(default_factory=lambda: defaultdict(Work))

    def record_execution(
        self,
        requests: int,
        rows: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        kind: str = "call",
        tokens: int = 0,
        context: int = 0,
    ) -> None:
        """One session run that served `requests` requests with `rows` batch rows (an LLM's
        runs also say their kind, new tokens and cached tokens over all rows)."""
        self.execution_count += 1
        self.inference_count += rows
        # Triton charges each request the whole execution's compute time.
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(infer_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        b = self.batches[rows]
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        self.last_inference_ms = time.time_ns() // 1_000_000
        w = self.work[kind]
        w.runs += 1
        w.rows += rows
        w.tokens += tokens
        w.tokens_sq += tokens * tokens
        w.row_context += context
        w.ns += infer_ns

    def record_request(self, ok: bool, ns: int) -> None:
        (self.success if ok else self.fail).add(ns)
