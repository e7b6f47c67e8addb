"""The LLM mode with several tenants at once (`--tenant`, repeated): each its own API key
and load shape (a closed loop's concurrency or an open loop's rate), all started together
on the same prompts, each measured apart: its TTFT percentiles, its served tokens, its
refusals; and Jain's fairness index of the tenants' served tokens,
(sum x)^2 / (n sum x^2): 1.0 when every tenant got the same, 1/n when one got everything.

A tenant is `NAME,KEY_VARIABLE,concurrency=C` or `NAME,KEY_VARIABLE,rate=R`: its key is read
from the environment variable KEY_VARIABLE (keys stay off the command line), e.g.
`--tenant heavy,HEAVY_KEY,concurrency=20 --tenant light,LIGHT_KEY,concurrency=2`. A fourth
part `after=S` starts that tenant S seconds after the others (a light tenant arriving on a
mesh a heavy one already fills): every tenant is measured over the same window, from the
latest start on; earlier starters' first seconds are their warm-up, unmeasured.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, replace

from loadtest.llm.runner import LLMLoad, closed_loop, open_loop
from loadtest.runner import Progress


@dataclass(frozen=True)
class TenantLoad:
    name: str
    key_variable: str
    concurrency: int = 0  # a closed loop, or
    rate: float = 0.0  # an open loop
    after: float = 0.0  # seconds after the run's start that this tenant starts sending

    @classmethod
    def parse(cls, text: str) -> TenantLoad:
        """ValueError says what is wrong with one --tenant value."""
        parts = text.split(",")
        if len(parts) not in (3, 4) or not parts[0] or not parts[1]:
            raise ValueError(
                f"--tenant {text!r}: expected NAME,KEY_VARIABLE,concurrency=C|rate=R[,after=S]"
            )
        after = 0.0
        if len(parts) == 4:
            kind, _, value = parts[3].partition("=")
            after = _number(value)
            if kind != "after" or after < 0:
                raise ValueError(f"--tenant {text!r}: after=S, seconds >= 0")
        kind, _, value = parts[2].partition("=")
        number = _number(value)
        if kind == "concurrency" and number >= 1 and number.is_integer():
            return cls(parts[0], parts[1], concurrency=int(number), after=after)
        if kind == "rate" and number > 0:
            return cls(parts[0], parts[1], rate=number, after=after)
        raise ValueError(f"--tenant {text!r}: concurrency=C (an integer >= 1) or rate=R (> 0)")

    def key(self) -> str:
        key = os.environ.get(self.key_variable)
        if not key:
            raise ValueError(f"tenant {self.name}: environment variable {self.key_variable} unset")
        return key


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return -1.0


def jain(values: list[float]) -> float | None:
    """Jain's fairness index of `values`; None when there is nothing to compare."""
    total, squares = sum(values), sum(v * v for v in values)
    return round(total * total / (len(values) * squares), 4) if squares else None


def served_tokens(run: dict) -> int:
    """What a tenant was served while every tenant's load ran: the prompt and completion
    tokens of its requests that ended within the window (not those drained after it, when
    the others may have stopped sending)."""
    return int(run["served_in_window"])


async def run_tenants(
    load: LLMLoad,
    tenants: list[TenantLoad],
    seed: int = 0,
    max_in_flight: int = 1000,
    progress: Progress | None = None,
) -> dict:
    """Every tenant's load at once (each from its `after`), measured over one window from
    the latest start on; -> {"tenants": {name: run}, "served_tokens", "jain"}."""
    latest = max(t.after for t in tenants)

    async def one(i: int, t: TenantLoad) -> dict:
        mine = replace(load, api_key=t.key(), warmup=load.warmup + latest - t.after)
        await asyncio.sleep(t.after)
        shown = _labelled(progress, t.name)
        if t.rate:
            return await open_loop(mine, t.rate, seed + i, max_in_flight, progress=shown)
        return await closed_loop(mine, t.concurrency, progress=shown)

    runs = await asyncio.gather(*(one(i, t) for i, t in enumerate(tenants)))
    served = {t.name: served_tokens(r) for t, r in zip(tenants, runs, strict=True)}
    return {
        "tenants": {t.name: r for t, r in zip(tenants, runs, strict=True)},
        "served_tokens": served,
        "jain": jain([float(v) for v in served.values()]),
    }


def _labelled(progress: Progress | None, name: str) -> Progress | None:
    if progress is None:
        return None
    return lambda line, final: progress(f"{name} {line}", final)


def table(result: dict) -> str:
    lines = ["tenant      requests  shed (with retry-after)  TTFT p50/p99 ms   served tokens"]
    for name, r in result["tenants"].items():
        ttft, shed = r["ttft_ms"], r["shed"]
        lines.append(
            f"{name:11s} {r['requests']:8d}  {shed['count']:5d} ({shed['with_retry_after']:5d})"
            f"            {ttft['p50'] or 0:7.1f}/{ttft['p99'] or 0:<8.1f}"
            f" {result['served_tokens'][name]:10d}"
        )
    lines.append(f"Jain's index of served tokens: {result['jain']}")
    return "\n".join(lines)
