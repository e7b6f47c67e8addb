"""The report's arithmetic on numbers worked out by hand."""

from __future__ import annotations

import datetime as dt

from ledger.economics import economics, serving_cost, token_economics
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


def test_token_break_even_counts_output_tokens() -> None:
    # 1,000 output tokens earned R = 300 micro-USD (per call and per token) at serving cost
    # S = 100: N* = T N / (R - S) = 1,000 x 1,000 / 200 = 5,000 output tokens.
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    t = token_economics(400, 1000, (50, 200), 220, 300, 1000, 100, 1000.0, {"stop": 3}, now)
    assert t.break_even_output_tokens == 5000 and not t.never_breaks_even
    assert t.serving_cost_per_1k_output_tokens_micro_usd == 100.0
    assert t.revenue_per_1k_output_tokens_micro_usd == 300.0
    assert t.projected_break_even == "2026-01-05"  # 4,000 more at 1,000 a day
    never = token_economics(400, 1000, (50, 200), 220, 300, 1000, 300, 1000.0, {}, now)
    assert never.never_breaks_even and never.break_even_output_tokens is None
    none = token_economics(0, 0, (50, 200), 0, 0, 1000, 0, 0.0, {}, now)
    assert none.break_even_output_tokens is None and "no output tokens" in none.statement


def test_the_report_shows_tokens_for_a_model_priced_per_token(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ledger import report
    from ledger.config import LedgerConfig
    from ledger.store import BatchEntry, Store

    store = Store(f"sqlite:///{tmp_path / 'l.db'}")
    llm = [2, 2, 0, 400, 1000, 10, 30, 8, 1, 1, 0]
    store.apply("r", [BatchEntry(1, {("smollm2", "1"): llm, ("mlp", "1"): [1, 1, 0, 5, 1]}, 1)], 1)
    store.record_model("smollm2", 200, 1_000_000, 50, 200)
    rows = {r.model: r for r in report.build(store, LedgerConfig())}
    t = rows["smollm2"].tokens
    assert t is not None and rows["mlp"].tokens is None
    assert (t.prompt_tokens, t.completion_tokens, t.token_revenue_micro_usd) == (10, 30, 8)
    assert t.revenue_micro_usd == 408 and t.finished == {"stop": 1, "length": 1, "other": 0}
    out = report.text(list(rows.values()))
    assert "tokens in / out       10 / 30" in out and "break-even N* (out)" in out
    assert "tokens in/out 10/30" in report.one_line(list(rows.values()))
