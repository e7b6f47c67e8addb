"""What the router counts, as values: a call's tokens, a model version's usage totals, the
receipt a refund takes back, and the live totals every router keeps in Redis (read back by
`read_usage`). Written by router/money/accounting.py; the ledger reads the same fields
(mesh_state.USAGE_FIELDS)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis

from common import mesh_state


def token_revenue(
    prompt: int,
    completion: int,
    per_1k_in: int,
    per_1k_out: int,
    cached: int = 0,
    per_1k_cached: int | None = None,
) -> int:
    """micro-USD for one call's tokens: ceil(((prompt - cached) x p_in + cached x p_cached +
    completion x p_out) / 1000), rounded up once per call (never more than 1 micro-USD above
    the exact price). `cached` of the prompt tokens came from the worker's prefix cache;
    p_cached defaults to p_in."""
    cached = min(cached, prompt)
    p_cached = per_1k_in if per_1k_cached is None else per_1k_cached
    exact = (prompt - cached) * per_1k_in + cached * p_cached + completion * per_1k_out
    return -(-exact // 1000)


@dataclass(frozen=True)
class Tokens:
    """Tokens billed (a call's, or a streamed piece's share of it) and their revenue."""

    prompt: int = 0
    completion: int = 0
    revenue_micro_usd: int = 0
    cached: int = 0  # of `prompt`, served from the prefix cache
    discount_micro_usd: int = 0  # what the cached tokens' lower price took off the revenue


NO_TOKENS = Tokens()
FINISHED = {"stop": "finished_stop", "length": "finished_length"}  # else finished_other


@dataclass
class Usage:
    calls: int = 0
    success: int = 0
    errors: int = 0
    revenue_micro_usd: int = 0
    upstream_ns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_revenue_micro_usd: int = 0
    finished_stop: int = 0
    finished_length: int = 0
    finished_other: int = 0
    cached_tokens: int = 0
    cached_discount_micro_usd: int = 0
    shed: int = 0  # of the errors: refused before they started (router/forwarding/shedding.py)

    def add(
        self,
        ok: bool,
        price: int,
        upstream_ns: int,
        tokens: Tokens = NO_TOKENS,
        finish: str | None = None,
        shed: bool = False,
    ) -> None:
        self.calls += 1
        self.shed += shed and not ok
        self.success += ok
        self.errors += not ok
        self.revenue_micro_usd += price if ok else 0
        self.upstream_ns += upstream_ns
        self.add_tokens(tokens)
        if ok and finish is not None:
            self._finish(finish, 1)

    def add_tokens(self, tokens: Tokens, sign: int = 1) -> None:
        self.prompt_tokens += sign * tokens.prompt
        self.completion_tokens += sign * tokens.completion
        self.token_revenue_micro_usd += sign * tokens.revenue_micro_usd
        self.cached_tokens += sign * tokens.cached
        self.cached_discount_micro_usd += sign * tokens.discount_micro_usd

    def _finish(self, reason: str, n: int) -> None:
        name = FINISHED.get(reason, "finished_other")
        setattr(self, name, getattr(self, name) + n)

    def refund(self, receipt: Receipt) -> None:
        """A call counted as a success whose client did not get it: an error after all (or,
        for a streamed piece, tokens recorded whose piece did not go out)."""
        if receipt.call:
            self.success -= 1
            self.errors += 1
            self.revenue_micro_usd -= receipt.price_micro_usd
            if receipt.finish is not None:
                self._finish(receipt.finish, -1)
        self.add_tokens(receipt.tokens, -1)

    def as_list(self) -> list[int]:
        return [getattr(self, f) for f in mesh_state.USAGE_FIELDS]


@dataclass(frozen=True)
class Receipt:
    """What `refund` needs to take back one recorded success (or streamed piece)."""

    model: str
    version: str
    price_micro_usd: int
    tokens: Tokens = NO_TOKENS
    finish: str | None = None
    call: bool = True  # False: only the tokens of one streamed piece
    tenant: str = ""  # whose call ("" with auth off)


async def read_usage(redis: aioredis.Redis) -> dict[tuple[str, str], Usage]:
    """Live totals over every router, as Redis holds them now."""
    totals: dict[tuple[str, str], Usage] = defaultdict(Usage)
    for router_id in await redis.smembers(mesh_state.ROUTERS):  # type: ignore[misc]
        fields = await redis.hgetall(mesh_state.usage_key(router_id))  # type: ignore[misc]
        for key, value in fields.items():
            model, version, name = mesh_state.parse_usage_field(key)
            u = totals[(model, version)]
            setattr(u, name, getattr(u, name) + int(value))
    return dict(totals)
