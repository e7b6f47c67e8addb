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
