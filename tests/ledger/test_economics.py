"""The report's arithmetic on numbers worked out by hand."""

from __future__ import annotations

import datetime as dt

from ledger.economics import economics, serving_cost
from ledger.store import WorkerSpan

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def test_serving_cost_is_uptime_times_price() -> None:
    spans = [
        WorkerSpan("a", 0, "cpu", 3_600_000),  # 1 h of cpu
        WorkerSpan("b", 0, "gpu", 1_800_000),  # 0.5 h of gpu
    ]
    prices = {"cpu": 100_000, "gpu": 2_000_000}
    assert serving_cost(spans, prices) == 100_000 + 1_000_000
    assert serving_cost(spans, prices, until_ms=900_000) == 25_000 + 500_000


def test_break_even_with_serving_cost() -> None:
    # p = 100, N = 1,000, serving 20,000 -> c = 20, p - c = 80; T = 8,000,000 -> N* = 100,000.
    e = economics("m", 1_000, 0, 100_000, 100, 8_000_000, 20_000, calls_per_day=9_900, now=NOW)
    assert e.cost_per_call_micro_usd == 20
    assert e.margin_per_call_micro_usd == 80
    assert e.break_even_calls == 100_000
    assert e.recovered_fraction == 100_000 / 8_000_000
    assert not e.never_breaks_even
    assert e.projected_break_even == "2026-01-11"  # 99,000 calls left at 9,900 a day
    assert "100,000 calls" in e.statement


def test_break_even_rounds_up() -> None:
    e = economics("m", 3, 0, 300, 100, 1_000, 1, calls_per_day=0, now=NOW)
    # c = 1/3, p - c = 299/3 -> N* = 3000/299 = 10.03 -> 11 calls
    assert e.break_even_calls == 11


def test_price_at_or_below_cost_never_breaks_even() -> None:
    e = economics("m", 100, 0, 5_000, 50, 1_000_000, 5_000, calls_per_day=10, now=NOW)
    assert e.cost_per_call_micro_usd == 50  # p == c
    assert e.never_breaks_even and e.break_even_calls is None
    assert e.statement.startswith("never breaks even")
    e = economics("m", 100, 0, 5_000, 50, 1_000_000, 9_000, calls_per_day=10, now=NOW)
    assert e.never_breaks_even and e.margin_per_call_micro_usd == -40


def test_recovered_and_no_calls() -> None:
    e = economics("m", 10, 2, 1_000, 100, 1_000, 0, calls_per_day=1, now=NOW)
    assert e.recovered_fraction == 1.0
    assert e.break_even_calls == 10
    assert e.statement.startswith("break-even reached")
    e = economics("m", 0, 0, 0, 100, 1_000, 500, calls_per_day=0, now=NOW)
    assert e.cost_per_call_micro_usd is None and e.break_even_calls is None
    assert e.statement.startswith("no calls yet")
