"""The ledger's report: economics per model from the durable store, as text, JSON or a plot."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

from ledger.config import LedgerConfig
from ledger.economics import (
    MS_PER_DAY,
    CacheEconomics,
    Economics,
    TokenEconomics,
    cache_economics,
    economics,
    serving_cost,
    token_economics,
)
from ledger.store import BUCKET_MS, Store

RATE_WINDOW_MS = 3_600_000  # the call rate that projects break-even: the last hour of calls


def build(store: Store, config: LedgerConfig, model: str | None = None) -> list[Economics]:
    usage = store.usage()
    spans = store.workers()
    total_cost = serving_cost(spans, config.machine_prices)
    terms = store.models()
    terms.update(
        {m: (t.price_micro_usd, t.training_cost_micro_usd) for m, t in config.models.items()}
    )
    token_prices = store.token_prices()
    token_prices.update(
        {
            m: (t.price_per_1k_input_tokens_micro_usd, t.price_per_1k_output_tokens_micro_usd)
            for m, t in config.models.items()
        }
    )
    per_model: dict[str, dict[str, int]] = {}
    for (name, _version), u in usage.items():
        agg = per_model.setdefault(name, dict.fromkeys(u, 0))
        for k, v in u.items():
            agg[k] += v
    upstream_total = sum(u["upstream_ns"] for u in per_model.values()) or 1
    now = dt.datetime.now(dt.UTC)
    out = []
    for name in sorted(per_model):
        if model and name != model:
            continue
        u = per_model[name]
        price, training = terms.get(name, (0, 0))
        # Machines serve every model: each model carries the share of upstream time it used.
        cost = total_cost * u["upstream_ns"] // upstream_total
        calls_per_day = _calls_per_day(store, name)
        row = economics(
            name,
            calls=u["success"],
            errors=u["errors"],
            revenue=u["revenue_micro_usd"],
            price=price,
            training_cost=training,
            serving=cost,
            calls_per_day=calls_per_day,
            now=now,
        )
        prices = token_prices.get(name, (0, 0))
        if any(prices) or u["completion_tokens"] or u["prompt_tokens"]:
            calls = u["success"] + u["errors"]
            # output tokens per day: the call rate x output tokens per call so far
            per_day = calls_per_day * u["completion_tokens"] / calls if calls else 0.0
            tokens = token_economics(
                u["prompt_tokens"],
                u["completion_tokens"],
                prices,
                u["token_revenue_micro_usd"],
                u["revenue_micro_usd"] + u["token_revenue_micro_usd"],
                training,
                cost,
                per_day,
                {k.removeprefix("finished_"): u[k] for k in u if k.startswith("finished_")},
                now,
            )
            if u["cached_tokens"] or u["cached_discount_micro_usd"]:
                cache = cache_economics(
                    u["prompt_tokens"],
                    u["cached_tokens"],
                    u["cached_discount_micro_usd"],
                    u["revenue_micro_usd"] + u["token_revenue_micro_usd"],
                    training,
                    cost,
                    u["completion_tokens"],
                )
                tokens = dataclasses.replace(tokens, cache=cache)
            row = dataclasses.replace(row, tokens=tokens)
        out.append(row)
    return out


def _calls_per_day(store: Store, model: str) -> float:
    buckets = store.buckets(model)
    if not buckets:
        return 0.0
    last = buckets[-1][0] + BUCKET_MS
    recent = [b for b in buckets if b[0] >= last - RATE_WINDOW_MS]
    span_ms = last - recent[0][0]
    return sum(b[1] for b in recent) / span_ms * MS_PER_DAY


def usd(micro: float | int | None) -> str:
    return "-" if micro is None else f"${micro / 1e6:,.9f}".rstrip("0").rstrip(".")


def text(rows: list[Economics]) -> str:
    if not rows:
        return "no calls recorded yet"
    lines = []
    for e in rows:
        lines += [
            f"model {e.model}",
            f"  calls N               {e.calls:,} (errors {e.errors:,})",
            f"  revenue p x N         {usd(e.revenue_micro_usd)}  (p = {usd(e.price_micro_usd)})",
            f"  training cost T       {usd(e.training_cost_micro_usd)}",
            f"  recovered p x N / T   {e.recovered_fraction:.4%}",
            f"  serving cost          {usd(e.serving_cost_micro_usd)}",
            f"  cost per call c       {usd(e.cost_per_call_micro_usd)}",
            f"  margin per call p - c {usd(e.margin_per_call_micro_usd)}",
            "  break-even N*         "
            + (
                "never"
                if e.never_breaks_even
                else f"{e.break_even_calls:,}"
                if e.break_even_calls
                else "-"
            ),
            f"  calls per day         {e.calls_per_day:,.0f}",
            f"  => {e.statement}",
        ]
        if e.tokens is not None:
            lines += _token_lines(e.tokens)
    return "\n".join(lines)


def _token_lines(t: TokenEconomics) -> list[str]:
    per_1k = (
        f"p_in = {usd(t.price_per_1k_input_tokens_micro_usd)}, "
        f"p_out = {usd(t.price_per_1k_output_tokens_micro_usd)} per 1k tokens"
    )
    be = (
        "never"
        if t.never_breaks_even
        else f"{t.break_even_output_tokens:,} output tokens"
        if t.break_even_output_tokens
        else "-"
    )
    return [
        f"  tokens in / out       {t.prompt_tokens:,} / {t.completion_tokens:,}",
        "  finished              " + ", ".join(f"{k} {v:,}" for k, v in sorted(t.finished.items())),
        f"  token revenue p x N   {usd(t.token_revenue_micro_usd)}  ({per_1k})",
        f"  revenue R (all)       {usd(t.revenue_micro_usd)}"
        f"  ({usd(t.revenue_per_1k_output_tokens_micro_usd)} per 1k output tokens)",
        f"  serving cost / 1k out {usd(t.serving_cost_per_1k_output_tokens_micro_usd)}",
        f"  break-even N* (out)   {be}"
        + (f", around {t.projected_break_even}" if t.projected_break_even else ""),
        f"  output tokens per day {t.output_tokens_per_day:,.0f}",
        f"  => {t.statement}",
        *_cache_lines(t.cache),
    ]


def _cache_lines(c: CacheEconomics | None) -> list[str]:
    if c is None:
        return []

    def be(n: int | None) -> str:
        return "never" if n is None else f"{n:,} output tokens"

    return [
        f"  cached tokens in      {c.cached_tokens:,} (hit rate {c.hit_rate:.1%})",
        f"  cache discount        {usd(c.discount_micro_usd)}",
        f"  break-even N* (out)   {be(c.break_even_output_tokens)} with the discount, "
        f"{be(c.break_even_without_discount)} without",
        f"  => {c.statement}",
    ]


@dataclasses.dataclass(frozen=True)
class TenantUsage:
    """One tenant's use of one model: what it was billed and what serving it cost."""

    tenant: str
    model: str
    calls: int  # successful calls
    errors: int
    prompt_tokens: int
    completion_tokens: int
    revenue_micro_usd: int  # per call + per token
    serving_cost_micro_usd: int  # machine time, by the share of upstream time its calls took
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache
    cached_discount_micro_usd: int = 0  # what their lower price took off the revenue

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, int | str | float]:
        return {**dataclasses.asdict(self), "hit_rate": round(self.hit_rate, 4)}


def by_tenant(store: Store, config: LedgerConfig) -> list[TenantUsage]:
    usage = store.tenant_usage()
    total_cost = serving_cost(store.workers(), config.machine_prices)
    upstream_total = sum(u["upstream_ns"] for u in store.usage().values()) or 1
    return [
        TenantUsage(
            tenant,
            model,
            u["success"],
            u["errors"],
            u["prompt_tokens"],
            u["completion_tokens"],
            u["revenue_micro_usd"] + u["token_revenue_micro_usd"],
            total_cost * u["upstream_ns"] // upstream_total,
            u["cached_tokens"],
            u["cached_discount_micro_usd"],
        )
        for (tenant, model), u in sorted(usage.items())
    ]


def tenant_text(rows: list[TenantUsage]) -> str:
    if not rows:
        return "no tenant calls recorded yet (auth off, or no calls)"
    lines = [
        f"{'tenant':20s} {'model':16s} {'calls':>10s} {'errors':>8s} {'tokens in/out':>17s} "
        f"{'revenue':>14s} {'serving cost':>14s} {'cached in':>11s} {'hit':>6s} "
        f"{'discount':>12s}"
    ]
    for r in rows:
        tokens = f"{r.prompt_tokens:,}/{r.completion_tokens:,}"
        lines.append(
            f"{r.tenant:20s} {r.model:16s} {r.calls:>10,} {r.errors:>8,} {tokens:>17s} "
            f"{usd(r.revenue_micro_usd):>14s} {usd(r.serving_cost_micro_usd):>14s} "
            f"{r.cached_tokens:>11,} {r.hit_rate:>6.1%} {usd(r.cached_discount_micro_usd):>12s}"
        )
    return "\n".join(lines)


def one_line(rows: list[Economics]) -> str:
    if not rows:
        return "ledger: no calls recorded"
    return "ledger: " + "; ".join(
        f"{e.model} N={e.calls:,} revenue={usd(e.revenue_micro_usd)} "
        f"T recovered {e.recovered_fraction:.4%}, cost/call={usd(e.cost_per_call_micro_usd)}, "
        + ("never breaks even" if e.never_breaks_even else f"break-even N*={e.break_even_calls}")
        + (
            f", tokens in/out {e.tokens.prompt_tokens:,}/{e.tokens.completion_tokens:,} "
            f"revenue R={usd(e.tokens.revenue_micro_usd)} break-even "
            + (
                "never"
                if e.tokens.never_breaks_even
                else f"N*={e.tokens.break_even_output_tokens} output tokens"
            )
            if e.tokens is not None
            else ""
        )
        for e in rows
    )


def plot(store: Store, config: LedgerConfig, rows: list[Economics], path: Path) -> None:
    """Cumulative revenue against T over time, and serving cost per call over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    spans = store.workers()
    fig, (ax_rev, ax_cost) = plt.subplots(1, 2, figsize=(12, 4.8))
    for e in rows:
        buckets = store.buckets(e.model)
        if not buckets:
            continue
        times, cum_rev, cost_per_call = [], [], []
        calls = revenue = 0
        for start_ms, n, r in buckets:
            end_ms = start_ms + BUCKET_MS
            calls += n
            revenue += r
            times.append(dt.datetime.fromtimestamp(end_ms / 1000, dt.UTC))
            cum_rev.append(revenue / 1e6)
            cost = serving_cost(spans, config.machine_prices, until_ms=end_ms)
            cost_per_call.append(cost / calls / 1e6 if calls else float("nan"))
        ax_rev.plot(times, cum_rev, "o-", label=f"{e.model}: revenue p x N")
        if e.training_cost_micro_usd:
            ax_rev.axhline(
                e.training_cost_micro_usd / 1e6,
                ls="--",
                color="tab:red",
                label=f"{e.model}: training cost T = {usd(e.training_cost_micro_usd)}",
            )
        ax_cost.plot(times, cost_per_call, "o-", label=f"{e.model}: serving cost per call c")
        ax_cost.axhline(
            e.price_micro_usd / 1e6,
            ls="--",
            color="tab:green",
            label=f"{e.model}: price per call p = {usd(e.price_micro_usd)}",
        )
        be = (
            "never"
            if e.never_breaks_even
            else f"{e.break_even_calls:,} calls"
            if e.break_even_calls
            else "-"
        )
        ax_rev.text(
            0.02,
            0.5,
            f"{e.model}: N = {e.calls:,}, recovered {e.recovered_fraction:.4%} of T\n"
            f"break-even N* = {be}"
            + (f" (~{e.projected_break_even})" if e.projected_break_even else ""),
            transform=ax_rev.transAxes,
            fontsize=9,
            va="center",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8},
        )
    ax_rev.set(title="Cumulative revenue against training cost T", ylabel="USD (log)", yscale="log")
    ax_cost.set(
        title="Serving cost per call (falls as use grows)",
        ylabel="USD per call (log)",
        yscale="log",
    )
    for ax in (ax_rev, ax_cost):
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.set_xlabel("time (UTC)")
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
