"""The arithmetic of the report: pure functions on integers (micro-USD, calls, ms).

Training cost T is recovered once p x N >= T. Serving has its own cost, machines x time, so
the margin per call is p - c with c = serving cost / N, and the break-even number of calls
is N* = T / (p - c) when p > c; when p <= c the model never pays back its training.
c falls as use grows: the same machines serve more calls.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from fractions import Fraction

from ledger.store import WorkerSpan

MS_PER_HOUR = 3_600_000
MS_PER_DAY = 86_400_000


def serving_cost(
    spans: list[WorkerSpan], prices: dict[str, int], until_ms: int | None = None
) -> int:
    """micro-USD of machine time: each worker's uptime (up to `until_ms`) x its kind's price."""
    total = Fraction(0)
    for s in spans:
        end = s.last_seen_ms if until_ms is None else min(s.last_seen_ms, until_ms)
        if end > s.started_ms:
            total += Fraction((end - s.started_ms) * prices.get(s.kind, 0), MS_PER_HOUR)
    return int(total)


@dataclass(frozen=True)
class Economics:
    model: str
    calls: int  # N: successful calls (the ones that earn p)
    errors: int
    revenue_micro_usd: int  # p x N, summed call by call
    price_micro_usd: int  # p
    training_cost_micro_usd: int  # T
    recovered_fraction: float  # p x N / T
    serving_cost_micro_usd: int
    cost_per_call_micro_usd: float | None  # c
    margin_per_call_micro_usd: float | None  # p - c
    break_even_calls: int | None  # N* = T / (p - c), None when never
    never_breaks_even: bool
    calls_per_day: float
    projected_break_even: str | None  # ISO date at the current call rate
    statement: str
    tokens: TokenEconomics | None = None  # a model priced per token, or that counted some

    def as_dict(self) -> dict:
        return asdict(self)


def economics(
    model: str,
    calls: int,
    errors: int,
    revenue: int,
    price: int,
    training_cost: int,
    serving: int,
    calls_per_day: float,
    now: dt.datetime,
) -> Economics:
    recovered = revenue / training_cost if training_cost else float("inf")
    cost_per_call = Fraction(serving, calls) if calls else None
    margin = price - cost_per_call if cost_per_call is not None else None
    break_even: int | None = None
    never = False
    projected = None
    if calls == 0 or margin is None:
        statement = "no calls yet: cost per call and break-even are unknown"
    elif margin <= 0:
        never = True
        statement = (
            f"never breaks even at this volume: serving costs {float(cost_per_call or 0):.1f} "
            f"micro-USD per call, at or above the price of {price}"
        )
    else:
        # N* = T / (p - c) with c = serving / N kept exact: N* = T N / (p N - serving), rounded up.
        break_even = -(-training_cost * calls // (price * calls - serving))
        remaining = break_even - calls
        if training_cost == 0:
            statement = "no training cost set: every call's margin is profit"
        elif remaining <= 0:
            statement = "break-even reached: (p - c) x N >= T"
        elif calls_per_day > 0:
            projected = (now + dt.timedelta(days=remaining / calls_per_day)).date().isoformat()
            statement = (
                f"break-even after {break_even:,} calls, around {projected} at the current rate"
            )
        else:
            statement = f"break-even after {break_even:,} calls; no current call rate to project"
    return Economics(
        model=model,
        calls=calls,
        errors=errors,
        revenue_micro_usd=revenue,
        price_micro_usd=price,
        training_cost_micro_usd=training_cost,
        recovered_fraction=round(recovered, 6) if training_cost else 0.0,
        serving_cost_micro_usd=serving,
        cost_per_call_micro_usd=round(float(cost_per_call), 3)
        if cost_per_call is not None
        else None,
        margin_per_call_micro_usd=round(float(margin), 3) if margin is not None else None,
        break_even_calls=break_even,
        never_breaks_even=never,
        calls_per_day=round(calls_per_day, 3),
        projected_break_even=projected,
        statement=statement,
    )


@dataclass(frozen=True)
class TokenEconomics:
    """An LLM priced per token: N counts output (completion) tokens. Revenue R is everything
    the model earned (per call and per token, exact sums of per-call charges), so the
    break-even N* = T N / (R - S) output tokens, S the serving cost: the input tokens earn
    their share at the ratio of input to output tokens seen so far."""

    prompt_tokens: int  # tokens in
    completion_tokens: int  # tokens out: N
    price_per_1k_input_tokens_micro_usd: int
    price_per_1k_output_tokens_micro_usd: int
    token_revenue_micro_usd: int  # the per-token part of R
    revenue_micro_usd: int  # R: per call + per token
    revenue_per_1k_output_tokens_micro_usd: float | None  # 1000 R / N
    serving_cost_per_1k_output_tokens_micro_usd: float | None  # 1000 S / N
    break_even_output_tokens: int | None  # N*, None when never or unknown
    never_breaks_even: bool
    output_tokens_per_day: float
    projected_break_even: str | None  # ISO date at the current token rate
    finished: dict[str, int]  # successful calls by finish reason: stop, length, other
    statement: str
    cache: CacheEconomics | None = None  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class CacheEconomics:
    """The prefix cache in the bill: cached prompt tokens (billed at the cached-input
    price), the hit rate (cached / prompt tokens), what the lower price cost (the revenue at
    the input price for every prompt token, minus the revenue billed), and the break-even
    with that discount (the one TokenEconomics reports, from the revenue billed) against the
    break-even had every prompt token been billed at the input price."""

    cached_tokens: int
    hit_rate: float
    discount_micro_usd: int
    break_even_output_tokens: int | None  # with the discount; None: never or unknown
    break_even_without_discount: int | None
    statement: str


def cache_economics(
    prompt_tokens: int,
    cached_tokens: int,
    discount: int,
    revenue: int,
    training_cost: int,
    serving: int,
    completion_tokens: int,
) -> CacheEconomics:
    n = completion_tokens

    def break_even(r: int) -> int | None:
        return -(-training_cost * n // (r - serving)) if n > 0 and r > serving else None

    with_discount, without = break_even(revenue), break_even(revenue + discount)
    rate = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    if discount == 0:
        statement = f"hit rate {rate:.1%}; no discount (cached tokens billed at the input price)"
    elif with_discount is None:
        statement = (
            f"hit rate {rate:.1%}; the discount ({discount:,} micro-USD) leaves revenue at or "
            "below serving cost: never breaks even with it"
            + ("" if without is None else f" (without it: {without:,} output tokens)")
        )
    else:
        extra = with_discount - (without or with_discount)
        statement = (
            f"hit rate {rate:.1%}; the discount cost {discount:,} micro-USD and moves "
            f"break-even by {extra:,} output tokens"
        )
    return CacheEconomics(
        cached_tokens, round(rate, 4), discount, with_discount, without, statement
    )


def token_economics(
    prompt_tokens: int,
    completion_tokens: int,
    prices: tuple[int, int],
    token_revenue: int,
    revenue: int,
    training_cost: int,
    serving: int,
    output_tokens_per_day: float,
    finished: dict[str, int],
    now: dt.datetime,
) -> TokenEconomics:
    n = completion_tokens
    break_even: int | None = None
    never = False
    projected = None
    if n <= 0:
        statement = "no output tokens yet: cost per token and break-even are unknown"
    elif revenue <= serving:
        never = True
        statement = (
            f"never breaks even at this volume: serving costs {1000 * serving / n:.1f} "
            f"micro-USD per 1k output tokens, at or above the {1000 * revenue / n:.1f} earned"
        )
    else:
        break_even = -(-training_cost * n // (revenue - serving))
        remaining = break_even - n
        if training_cost == 0:
            statement = "no training cost set: every token's margin is profit"
        elif remaining <= 0:
            statement = "break-even reached: R - S >= T"
        elif output_tokens_per_day > 0:
            days = remaining / output_tokens_per_day
            projected = (now + dt.timedelta(days=min(days, 3_000_000))).date().isoformat()
            statement = (
                f"break-even after {break_even:,} output tokens, around {projected} "
                "at the current rate"
            )
        else:
            statement = f"break-even after {break_even:,} output tokens; no current rate to project"
    return TokenEconomics(
        prompt_tokens=prompt_tokens,
        completion_tokens=n,
        price_per_1k_input_tokens_micro_usd=prices[0],
        price_per_1k_output_tokens_micro_usd=prices[1],
        token_revenue_micro_usd=token_revenue,
        revenue_micro_usd=revenue,
        revenue_per_1k_output_tokens_micro_usd=round(1000 * revenue / n, 3) if n > 0 else None,
        serving_cost_per_1k_output_tokens_micro_usd=round(1000 * serving / n, 3) if n > 0 else None,
        break_even_output_tokens=break_even,
        never_breaks_even=never,
        output_tokens_per_day=round(output_tokens_per_day, 3),
        projected_break_even=projected,
        finished=finished,
        statement=statement,
    )
