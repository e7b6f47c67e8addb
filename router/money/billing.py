"""What a worker's response says about its usage, read from its bytes, and what it costs.

The router bills an LLM call from the worker's responses without decoding them: the bytes
are parsed as `ResponseHeader` / `StreamResponseHeader` (protos/usage.proto), which read the
response's id, its `parameters` map and a stream response's error message and skip the
tensors. The worker sets `prompt_tokens` and a running `completion_tokens` on every piece of
a stream (the tokens generated up to that piece), `finish_reason` on the final one, and
`triton_final_response` on each piece of a decoupled model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from common import llm_protocol
from common.mesh_state import ModelEntry
from protos.usage_pb2 import ResponseHeader, StreamResponseHeader, UsageParameter
from router.money.accounting import Tokens, token_revenue


@dataclass(frozen=True)
class Piece:
    """One response as the router reads it."""

    final: bool  # the request's last response: flagged final, or a model that is not decoupled
    error: str = ""  # a stream response's error_message
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None
    # the ids of the tokens this piece adds (llm_protocol.TOKEN_IDS, when the router asked
    # for them): what a migrated stream resumes from; None: not sent, or not a list of ints
    token_ids: tuple[int, ...] | None = None
    choice: int | None = None  # llm_protocol.INDEX: one choice of several (n > 1)


def priced_per_token(entry: ModelEntry) -> bool:
    return bool(
        entry.price_per_1k_input_tokens_micro_usd or entry.price_per_1k_output_tokens_micro_usd
    )


def _piece(header: ResponseHeader, error: str = "") -> Piece:
    params = header.parameters

    def count(name: str) -> int | None:
        p = params.get(name)
        if p is None or p.WhichOneof("parameter_choice") != "int64_param":
            return None
        return max(p.int64_param, 0)

    reason = params.get(llm_protocol.FINISH_REASON)
    index = params.get(llm_protocol.INDEX)
    return Piece(
        final=llm_protocol.is_final(params),
        error=error,
        prompt_tokens=count(llm_protocol.PROMPT_TOKENS),
        completion_tokens=count(llm_protocol.COMPLETION_TOKENS),
        finish_reason=reason.string_param if reason is not None else None,
        cached_tokens=count(llm_protocol.CACHED_TOKENS),
        token_ids=_ids(params.get(llm_protocol.TOKEN_IDS)),
        choice=index.int64_param if index is not None else None,
    )


def _ids(p: UsageParameter | None) -> tuple[int, ...] | None:
    if p is None or p.WhichOneof("parameter_choice") != "string_param":
        return None
    try:
        ids = json.loads(p.string_param)
    except ValueError:
        return None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        return None
    return tuple(ids)


def unary_piece(raw: bytes) -> Piece:
    """A ModelInferResponse's usage (a unary reply is its call's only response)."""
    try:
        return _piece(ResponseHeader.FromString(raw))
    except DecodeError:
        return Piece(final=True)


def stream_piece(raw: bytes) -> Piece:
    """A ModelStreamInferResponse's usage; an error response ends its request."""
    try:
        header = StreamResponseHeader.FromString(raw)
    except DecodeError:
        return Piece(final=True, error="the worker's response does not parse")
    if header.error_message:
        return Piece(final=True, error=header.error_message)
    return _piece(header.infer_response)


@dataclass
class TokenMeter:
    """A call's tokens billed so far. Counts only grow; each step bills the difference, and
    the revenue billed is always ceil(total / 1000) of the call's tokens so far, so the
    pieces of a stream add up to exactly the price of the whole call.

    Cached prompt tokens (the worker's `cached_tokens`, at most the prompt) are billed at
    `per_1k_cached`, once: like the other counts the cached count only grows, and each piece
    bills the difference. The discount is the revenue at the input price for every prompt
    token minus the revenue billed, both rounded once per call, so it too adds up exactly."""

    per_1k_in: int
    per_1k_out: int
    per_1k_cached: int | None = None  # None: the input price
    prompt: int = 0
    completion: int = 0
    revenue: int = 0
    cached: int = 0
    discount: int = 0

    @classmethod
    def of(cls, entry: ModelEntry) -> TokenMeter:
        return cls(
            entry.price_per_1k_input_tokens_micro_usd,
            entry.price_per_1k_output_tokens_micro_usd,
            entry.cached_input_price,
        )

    def advance(self, piece: Piece) -> Tokens:
        """The tokens a piece adds (none when it carries no counts)."""
        prompt = max(self.prompt, piece.prompt_tokens or 0)
        completion = max(self.completion, piece.completion_tokens or 0)
        cached = min(max(self.cached, piece.cached_tokens or 0), prompt)
        revenue = token_revenue(
            prompt, completion, self.per_1k_in, self.per_1k_out, cached, self.per_1k_cached
        )
        full = token_revenue(prompt, completion, self.per_1k_in, self.per_1k_out)
        delta = Tokens(
            prompt - self.prompt,
            completion - self.completion,
            revenue - self.revenue,
            cached - self.cached,
            full - revenue - self.discount,
        )
        self.prompt, self.completion, self.revenue = prompt, completion, revenue
        self.cached, self.discount = cached, full - revenue
        return delta

    def take_back(self, delta: Tokens) -> None:
        """A piece whose delivery failed: its tokens are not billed after all."""
        self.prompt -= delta.prompt
        self.completion -= delta.completion
        self.revenue -= delta.revenue_micro_usd
        self.cached -= delta.cached
        self.discount -= delta.discount_micro_usd
