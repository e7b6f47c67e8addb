"""The ledger's report: economics per model from the durable store, as text, JSON or a plot."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from ledger.config import LedgerConfig
from ledger.economics import MS_PER_DAY, Economics, economics, serving_cost
from ledger.store import Store

RATE_WINDOW_MINUTES = 60


def build(store: Store, config: LedgerConfig, model: str | None = None) -> list[Economics]:
    usage = store.usage()
    spans = store.workers()
    total_cost = serving_cost(spans, config.machine_prices)
    terms = store.models()
    terms.update(
        {m: (t.price_micro_usd, t.training_cost_micro_usd) for m, t in config.models.items()}
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
        out.append(
            economics(
                name,
                calls=u["success"],
                errors=u["errors"],
                revenue=u["revenue_micro_usd"],
                price=price,
                training_cost=training,
                serving=cost,
                calls_per_day=_calls_per_day(store, name),
                now=now,
            )
        )
    return out


def _calls_per_day(store: Store, model: str) -> float:
    minutes = store.minutes(model)
    if not minutes:
        return 0.0
    last = minutes[-1][0]
    recent = [m for m in minutes if m[0] > last - RATE_WINDOW_MINUTES]
    span = max(1, last - recent[0][0] + 1)
    return sum(m[1] for m in recent) / span * (MS_PER_DAY / 60_000)


def usd(micro: float | int | None) -> str:
    return "-" if micro is None else f"${micro / 1e6:,.6f}".rstrip("0").rstrip(".")


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
    return "\n".join(lines)


def one_line(rows: list[Economics]) -> str:
    if not rows:
        return "ledger: no calls recorded"
    return "ledger: " + "; ".join(
        f"{e.model} N={e.calls:,} revenue={usd(e.revenue_micro_usd)} "
        f"T recovered {e.recovered_fraction:.4%}, cost/call={usd(e.cost_per_call_micro_usd)}, "
        + ("never breaks even" if e.never_breaks_even else f"break-even N*={e.break_even_calls}")
        for e in rows
    )


def plot(store: Store, config: LedgerConfig, rows: list[Economics], path: Path) -> None:
    """Cumulative revenue against T over time, and serving cost per call over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = store.workers()
    fig, (ax_rev, ax_cost) = plt.subplots(1, 2, figsize=(12, 4.5))
    for e in rows:
        minutes = store.minutes(e.model)
        if not minutes:
            continue
        times = [dt.datetime.fromtimestamp((m + 1) * 60, dt.UTC) for m, _, _ in minutes]
        calls = revenue = 0
        cum_rev, cost_per_call = [], []
        for m, n, r in minutes:
            calls += n
            revenue += r
            cum_rev.append(revenue / 1e6)
            cost = serving_cost(spans, config.machine_prices, until_ms=(m + 1) * 60_000)
            cost_per_call.append(cost / calls / 1e6 if calls else float("nan"))
        ax_rev.step(times, cum_rev, where="post", label=f"{e.model}: revenue p x N")
        if e.training_cost_micro_usd:
            ax_rev.axhline(
                e.training_cost_micro_usd / 1e6,
                ls="--",
                color="tab:red",
                label=f"{e.model}: training cost T",
            )
        ax_cost.plot(times, cost_per_call, marker="o", label=f"{e.model}: serving cost per call")
        ax_cost.axhline(
            e.price_micro_usd / 1e6,
            ls="--",
            color="tab:green",
            label=f"{e.model}: price per call p",
        )
    ax_rev.set(title="Cumulative revenue against training cost", ylabel="USD")
    ax_rev.set_yscale("symlog", linthresh=1e-3)
    ax_cost.set(title="Serving cost per call (falls as use grows)", ylabel="USD per call")
    ax_cost.set_yscale("log")
    for ax in (ax_rev, ax_cost):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
