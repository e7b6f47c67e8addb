"""One LLM run's numbers, from the outcome of each request that started in the measured
window. What each means:

- `ttft_ms`: time to first token — from the request's start (its scheduled arrival in an
  open loop) to the first response holding non-empty text.
- `itl_ms`: inter-token latency — every gap between two consecutive non-empty pieces of a
  request, per token: divided by the tokens the later piece carried when the server says
  per piece (`num_output_tokens`), else by the request's average tokens per gap,
  (completion tokens - 1) / (pieces - 1). With one token a piece (`tokens_per_piece` 1.0)
  that is exact. When tokens cannot be counted at all (no usage from the server and no
  `--tokenizer`) the gaps are per piece and `itl_unit` says "piece".
- `e2e_ms`: start to the final response.
- `stream_tokens_per_s`: one request's completion tokens / its end-to-end seconds (what
  one user's stream delivers, TTFT included); its low tail (p10, min) is the slow streams.
- `output_tokens_per_s`: every successful request's completion tokens / `seconds`, the span
  from the opening of the measured window to the last measured request's end, or to the
  end of an open loop's schedule if later (the drain included, so a closed loop of long
  requests is not overstated; an open loop's quiet stretches are not left out);
  `throughput_rps` is requests over the same span.
- `prompt_tokens` / `completion_tokens`: per request, from the server's usage when present
  (`token_source` counts "server", "tokenizer" and "pieces" requests); with
  `count="tokenizer"` always from the tokenizer, re-tokenizing the prompt and the returned
  text, so servers that count differently (or not at all) are counted alike.
- `per_request`: each measured request's start (s after the first), TTFT, e2e, tokens,
  pieces and finish reason, or its error; and its own `itl_ms`, (last piece - first piece)
  / (its tokens after the first piece: completion tokens - 1 unless the server counted the
  first piece), the mean of its gaps per token as `itl_ms` above weighs them.
- `errors`: by gRPC status code, or "stream: <message>" for an error sent on the stream
  (numbers folded to N so one failure mode is one key). Failed requests are in no
  latency and no token count.
- `shed`: the errors that were refusals for overload (RESOURCE_EXHAUSTED, HTTP 429): how
  many, how many said when to come back (gRPC `retry-after` metadata or the stream's error
  parameters, HTTP Retry-After), and those waits in seconds. `ttft_ms` is then the
  accepted requests' alone.
"""

from __future__ import annotations

from collections import Counter

from hdrh.histogram import HdrHistogram
from tokenizers import Tokenizer

from loadtest.llm.prompts import count_tokens
from loadtest.llm.stream import Outcome
from loadtest.stats import PERCENTILES, Recorder

LATENCY_KEYS = {k: v for k, v in PERCENTILES.items() if k != "p999_ms"}


class Counts:
    """An HDR histogram of positive numbers kept to 1/scale (3 significant figures)."""

    def __init__(self, scale: int = 1, highest: int = 10**9) -> None:
        self.scale = scale
        self.histogram = HdrHistogram(1, highest, 3)

    def add(self, value: float) -> None:
        self.histogram.record_value(
            max(1, min(self.histogram.highest_trackable_value, round(value * self.scale)))
        )

    def summary(self, percentiles: tuple[float, ...]) -> dict:
        h, n = self.histogram, self.histogram.get_total_count()
        if not n:
            return {"count": 0}
        out = {f"p{p:g}": round(h.get_value_at_percentile(p) / self.scale, 3) for p in percentiles}
        out.update(
            count=int(n),
            mean=round(h.get_mean_value() / self.scale, 3),
            min=round(h.get_min_value() / self.scale, 3),
            max=round(h.get_max_value() / self.scale, 3),
        )
        return out


def latency(r: Recorder) -> dict:
    s = r.summary(1)
    return {key.removesuffix("_ms"): s[key] for key in (*LATENCY_KEYS, "mean_ms", "max_ms")}


COUNTS = ("server", "tokenizer")  # whose token counts: the server's usage first, or ours


class LLMRecorder:
    def __init__(self, tokenizer: Tokenizer | None = None, count: str = "server") -> None:
        if count not in COUNTS:
            raise ValueError(f"count: expected one of {COUNTS}, got {count!r}")
        if count == "tokenizer" and tokenizer is None:
            raise ValueError("count='tokenizer' needs a tokenizer")
        self.tokenizer = tokenizer
        self.trust_server = count == "server"
        self.ttft, self.itl, self.e2e = Recorder(), Recorder(), Recorder()
        self.stream_tps = Counts(scale=1000)
        self.prompt_tokens, self.completion_tokens = Counts(), Counts()
        self.errors: Counter[str] = Counter()
        self.sources: Counter[str] = Counter()
        self.count = self.output_tokens = self.input_tokens = self.pieces = 0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.itl_unit = "token"
        self.rows: list[dict] = []  # one per request, for the JSON
        self.shed = self.shed_with_retry = 0
        self.ends: list[tuple[float, int]] = []  # (end, prompt + completion tokens) per success
        self.retry_after = Counts(scale=1000)

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def add(self, out: Outcome, prompt: str) -> None:
        if self.first_start is None or out.start < self.first_start:
            self.first_start = out.start
        if self.last_end is None or out.end > self.last_end:
            self.last_end = out.end
        row: dict = {"start_s": out.start, "error": out.error}  # made relative in summary
        self.rows.append(row)
        if out.error is not None:
            self.error(out.error)
            self._shed(out)
            return
        tokens, source = self._completion_tokens(out)
        self.sources[source] += 1
        self.count += 1
        self.output_tokens += tokens
        self.pieces += len(out.pieces)
        prompt_tokens = out.prompt_tokens if self.trust_server else None
        if prompt_tokens is None and self.tokenizer is not None:
            prompt_tokens = count_tokens(self.tokenizer, prompt)
        if prompt_tokens is not None:
            self.input_tokens += prompt_tokens
            self.prompt_tokens.add(prompt_tokens)
        self.completion_tokens.add(tokens)
        self.ends.append((out.end, tokens + (prompt_tokens or 0)))
        e2e = out.end - out.start
        self.e2e.ok(e2e)
        if e2e > 0 and tokens:
            self.stream_tps.add(tokens / e2e)
        if out.pieces:
            self.ttft.ok(out.pieces[0] - out.start)
        self._itl(out, tokens, source)
        row.update(
            ttft_ms=round((out.pieces[0] - out.start) * 1000, 3) if out.pieces else None,
            itl_ms=_request_itl_ms(out.pieces, tokens - self._first_piece_tokens(out)),
            e2e_ms=round(e2e * 1000, 3),
            prompt_tokens=prompt_tokens,
            completion_tokens=tokens,
            pieces=len(out.pieces),
            finish_reason=out.finish_reason,
        )

    def served_until(self, end: float) -> int:
        """Prompt and completion tokens of the requests that ended by `end`: what the
        server gave this client while its load lasted (a tenant's share: llm/tenants.py)."""
        return sum(tokens for at, tokens in self.ends if at <= end)

    def _shed(self, out: Outcome) -> None:
        if not out.shed:
            return
        self.shed += 1
        try:
            wait = float(out.retry_after) if out.retry_after is not None else None
        except ValueError:
            wait = None
        if wait is not None and wait >= 0:
            self.shed_with_retry += 1
            self.retry_after.add(wait)

    def _completion_tokens(self, out: Outcome) -> tuple[int, str]:
        if out.completion_tokens is not None and self.trust_server:
            return out.completion_tokens, "server"
        if self.tokenizer is not None:
            return count_tokens(self.tokenizer, out.text), "tokenizer"
        return len(out.pieces), "pieces"

    def _server_counted_pieces(self, out: Outcome) -> bool:
        return self.trust_server and bool(out.pieces) and len(out.piece_tokens) == len(out.pieces)

    def _first_piece_tokens(self, out: Outcome) -> int:
        return out.piece_tokens[0] if self._server_counted_pieces(out) else 1

    def _itl(self, out: Outcome, tokens: int, source: str) -> None:
        gaps = [b - a for a, b in zip(out.pieces, out.pieces[1:], strict=False)]
        if self._server_counted_pieces(out):
            for gap, n in zip(gaps, out.piece_tokens[1:], strict=True):
                for _ in range(max(1, n)):
                    self.itl.ok(gap / max(1, n))
            return
        if source == "pieces":
            self.itl_unit = "piece"
        per_gap = (tokens - 1) / len(gaps) if gaps and tokens > 1 else 1.0
        for gap in gaps:
            self.itl.ok(gap / per_gap)

    def summary(self, window_start: float | None = None, window_end: float = 0.0) -> dict:
        """`window_start`: when the measured window opened (default: the first start);
        `window_end`: the span lasts at least until then (an open loop's schedule)."""
        span = 1e-9
        begin = self.first_start if window_start is None else window_start
        if begin is not None and self.last_end is not None:
            span = max(span, max(self.last_end, window_end) - begin)
        return {
            "requests": self.count,
            "errors": dict(self.errors),
            "seconds": round(span, 3),
            "throughput_rps": round(self.count / span, 3),
            "output_tokens": self.output_tokens,
            "prompt_tokens_total": self.input_tokens,
            "output_tokens_per_s": round(self.output_tokens / span, 2),
            "ttft_ms": latency(self.ttft),
            "itl_ms": latency(self.itl),
            "itl_unit": self.itl_unit,
            "e2e_ms": latency(self.e2e),
            "stream_tokens_per_s": self.stream_tps.summary((10, 50, 90)),
            "prompt_tokens": self.prompt_tokens.summary((50, 90, 99)),
            "completion_tokens": self.completion_tokens.summary((50, 90, 99)),
            "tokens_per_piece": round(self.output_tokens / self.pieces, 3) if self.pieces else None,
            "token_source": dict(self.sources),
            "shed": {
                "count": self.shed,
                "with_retry_after": self.shed_with_retry,
                "retry_after_s": self.retry_after.summary((50, 99)),
            },
            "cdf": self.ttft.cdf(),  # TTFT, [percentile, ms]
            "per_request": [  # start_s from the first measured start, in start order
                {**row, "start_s": round(row["start_s"] - (self.first_start or 0.0), 6)}
                for row in sorted(self.rows, key=lambda row: row["start_s"])
            ],
        }


def _request_itl_ms(pieces: list[float], after_first: int) -> float | None:
    """One request's mean inter-token latency: (last piece - first) / the tokens after the
    first piece; None with fewer than two pieces or no token after the first."""
    if len(pieces) < 2 or after_first < 1:
        return None
    return round((pieces[-1] - pieces[0]) / after_first * 1000, 3)
