"""The anchor in interleaved rounds (`python -m benchmarks.llm --systems llama-server`; its
default `--anchor-mode paired`): llama.cpp's llama-server and the meshserve worker are all
started first and stay up, and every figure is measured in rounds that take turns between
them, so that this VM's drift (+-20% over minutes) falls on both sides alike.

- Sides: llama-server once per OMP_WAIT_POLICY asked for (and per n-gram setting with
  --speculative), and the worker, each with the same 2 threads as the sequential anchor
  (llm_serve.py). One side is loaded at a time; the idle ones are not meant to spin
  (llama-server blocks on its task queue while no slot is busy, its OpenMP threads sleeping
  at once under PASSIVE, after libgomp's short spin unset; the worker's engine waits on an
  event, and its spinning onnxruntime pool spins only during and just after a run). Measured
  rather than assumed: `idle_cpu` holds each side's CPU seconds while another was loaded.
- Round r runs the sides in the order `order(sides, r)`: ABC, CBA, BCA, ACB, CAB, BAC, ...;
  every two rounds each pair of sides runs in both orders (ABBA), so a drift that is linear
  over the two rounds falls on both alike. A turn is followed by SETTLE_S of quiet.
- A round is the same on every side, with the sequential anchor's prompts (llm_serve.measure):
  single stream: a 1-token request (it opens the connection), then --decode-tokens after
  a ~25-token prompt of its own: TTFT and decode tokens/s after the first token; a load
  level: c closed-loop streams over the LOAD_SIZES prompts (one set, seed 2, for every
  round and level, as before: with fresh prompts each round llama-server's RSS peak
  reached 3.1-3.2 GB here against ~1.1 GB, its RAM prompt cache, --cache-ram 8 GiB by
  default, the likely cause), 2c requests of 64 tokens, sent for at most --anchor-seconds
  (each request's deadline 300 s).
- Verdict: per target, the ratio of each round (the worker's figure over that same round's
  llama-server figure), and the median of those per-round ratios against the target, taken
  against the llama-server setting that leaves the worker's median weakest. ITL p99 / p50 is
  the worker's own, per round; the RSS peaks are the whole run's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from benchmarks import llm_serve
from benchmarks.common import RssSampler, cpu_seconds, process_tree, rss_tree_mb
from loadtest.llm import prompts as prompt_source
from loadtest.llm.prompts import Prompt
from loadtest.llm.runner import LLMLoad, closed_loop
from planner.probe import host_cpu

SETTLE_S = 0.5  # quiet after each turn: a spinning pool winds down before the next side
WORKER = "meshserve"
TIMEOUT_S = 300.0  # one request's deadline


@dataclass(frozen=True)
class Side:
    """A server as a round reaches it; `pid` for its CPU and RSS (its process tree)."""

    name: str
    address: str
    api: str  # "openai" (llama-server) or "triton" (the worker)
    model: str
    pid: int


def order(names: Sequence[str], r: int) -> list[str]:
    """Round r's turns: rotated by r // 2, mirrored on odd rounds (ABC CBA BCA ACB CAB BAC;
    two sides: AB BA BA AB)."""
    k = (r // 2) % len(names)
    turn = [*names[k:], *names[:k]]
    return turn[::-1] if r % 2 else turn


# ---- pairing and verdict: pure functions of the per-round figures ---------------------------


def ratios(worker: Sequence[float | None], server: Sequence[float | None]) -> list[float | None]:
    """The worker's figure over the server's, round by round (None where either is missing)."""
    return [w / s if w and s else None for w, s in zip(worker, server, strict=True)]


def median(values: Sequence[float | None]) -> float | None:
    """The median of the rounds that have a figure; None if at most half of them do."""
    have = [v for v in values if v is not None]
    return statistics.median(have) if have and 2 * len(have) > len(values) else None


def _met(value: float | None, target: float, better: str) -> bool:
    return value is not None and (value >= target if better == "higher" else value <= target)


def _shown(value: float | None, target: float) -> float | None:
    # met or missed on the unrounded ratio: 1.002 is over a target of 1.0, not "1.0"
    return None if value is None else round(value, 3 if round(value, 2) == target else 2)


def _round(values: Sequence[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 3) for v in values]


Figures = Callable[[dict], list[float | None]]


def paired_check(
    servers: dict[str, dict], worker: dict, figures: Figures, target: float, better: str
) -> dict:
    """One target: per-round ratios against each llama-server setting, and the verdict on the
    median of those against the setting that leaves the worker's median weakest."""
    per = {name: ratios(figures(worker), figures(s)) for name, s in servers.items()}
    medians = {name: median(r) for name, r in per.items()}
    none = float("-inf") if better == "higher" else float("inf")  # a missing figure is weakest

    def weakness(name: str) -> float:
        m = medians[name]
        return none if m is None else (m if better == "higher" else -m)

    against = min(per, key=weakness)
    value = medians[against]
    return {
        "value": _shown(value, target),
        "target": target,
        "better": better,
        "met": _met(value, target, better),
        "against": against,
        "rounds": _round(per[against]),
        "medians": {name: _shown(m, target) for name, m in medians.items()},
    }


def own_check(rounds: Sequence[float | None], target: float) -> dict:
    """A figure of the worker's own (ITL p99 over p50), judged on its median over rounds."""
    value = median(rounds)
    return {
        "value": _shown(value, target),
        "target": target,
        "better": "lower",
        "met": _met(value, target, "lower"),
        "rounds": _round(rounds),
    }


def _single(key: str) -> Figures:
    return lambda side: [e[key] for e in side["single"]["each_round"]]


def _level(i: int) -> Figures:
    return lambda side: [e["output_tokens_per_s"] for e in side["load"][i]["each_round"]]


def itl_ratios(level: dict) -> list[float | None]:
    return [
        e["itl_ms"]["p99"] / e["itl_ms"]["p50"] if e["itl_ms"].get("p50") else None
        for e in level["each_round"]
    ]


def paired_targets(worker: dict) -> dict[str, tuple[Figures, float, str]]:
    """Issue 25's targets against llama-server: name -> (the per-round figures, the target
    for the worker's ratio, "higher" or "lower" is better)."""
    out: dict[str, tuple[Figures, float, str]] = {
        "single_decode_vs_llama_server": (_single("decode_tokens_per_s"), 1.1, "higher"),
        "single_ttft_vs_llama_server": (_single("ttft_ms"), 1.0, "lower"),
    }
    for i, lw in enumerate(worker["load"]):
        if (c := lw["streams"]) in llm_serve.AGGREGATE_TARGETS:
            target = llm_serve.AGGREGATE_TARGETS[c]
            out[f"aggregate_{c}_vs_llama_server"] = (_level(i), target, "higher")
    return out


def verdict(servers: dict[str, dict], worker: dict) -> tuple[dict, list[str]]:
    """Issue 25's targets on the per-round ratios; a miss is written as a miss."""
    checks = {
        name: paired_check(servers, worker, figures, target, better)
        for name, (figures, target, better) in paired_targets(worker).items()
    }
    for lw in worker["load"]:
        checks[f"itl_p99_over_p50_{lw['streams']}"] = own_check(itl_ratios(lw), 3.0)
    peaks = {n: s["rss_mb"].get("peak") for n, s in servers.items()}
    lowest = min(peaks, key=lambda n: peaks[n] or float("inf"))
    rss = ratios([worker["rss_mb"].get("peak")], [peaks[lowest]])[0]
    checks["rss_peak_vs_llama_server"] = {
        "value": _shown(rss, 1.0),
        "target": 1.0,
        "better": "lower",
        "met": _met(rss, 1.0, "lower"),
        "against": lowest,
    }
    return checks, [line(name, c) for name, c in checks.items()]


def line(name: str, c: dict) -> str:
    sign = ">=" if c["better"] == "higher" else "<="
    how = []
    if "rounds" in c:
        how.append(f"median of {len(c['rounds'])} rounds {c['rounds']}")
    if "against" in c:
        how.append(f"against llama-server, OMP_WAIT_POLICY {c['against']}")
    more = "; ".join(how)
    return (
        f"{name}: {c['value']} (target {sign} {c['target']}{'; ' + more if more else ''}): "
        f"{'met' if c['met'] else 'MISSED'}"
    )


# ---- the rounds -----------------------------------------------------------------------------


class Turns:
    """Runs one side's turn at a time, then SETTLE_S of quiet, and keeps the log: when each
    turn ran, the CPU its side used and the CPU every process outside this run used (the
    machine's busy time less the sides' and this client's: `others_cores`, how contended
    the turn was), and the CPU every side used during the others' turns (`report`)."""

    def __init__(self, sides: Sequence[Side]) -> None:
        self.sides = {s.name: s for s in sides}
        self.started = time.monotonic()
        self.log: list[dict] = []
        self.idle = {n: [0.0, 0.0] for n in self.sides}  # CPU s, wall s: others' turns
        self.settle = {n: [0.0, 0.0] for n in self.sides}  # the same, just after its own

    def _cpu(self) -> dict[str, float]:
        return {n: cpu_seconds(process_tree(s.pid)) for n, s in self.sides.items()}

    def _outside(self, cpu: dict[str, float]) -> float:
        """CPU seconds the machine spent so far less the sides' and this process's."""
        return machine_busy_s() - sum(cpu.values()) - time.process_time()

    async def run(self, what: str, r: int, name: str, job: Awaitable[dict]) -> dict:
        before, t0 = self._cpu(), time.monotonic()
        outside = self._outside(before)
        out = await job
        mid, t1 = self._cpu(), time.monotonic()
        others = self._outside(mid) - outside
        await asyncio.sleep(SETTLE_S)
        after, t2 = self._cpu(), time.monotonic()
        for n in self.sides:
            if n != name:
                self.idle[n][0] += mid[n] - before[n]
                self.idle[n][1] += t1 - t0
        self.settle[name][0] += after[name] - mid[name]
        self.settle[name][1] += t2 - t1
        self.log.append(
            {
                "what": what,
                "round": r,
                "side": name,
                "at_s": round(t0 - self.started, 1),
                "wall_s": round(t1 - t0, 2),
                "cpu_s": round(mid[name] - before[name], 2),
                "others_cores": _cores(max(others, 0.0), t1 - t0),
            }
        )
        return out

    def report(self) -> dict:
        def share(cpu: float, wall: float) -> dict:
            return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 1), "cores": _cores(cpu, wall)}

        return {
            n: {
                "during_others_turns": share(*self.idle[n]),
                "settle_after_own": share(*self.settle[n]),
            }
            for n in self.sides
        }


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat)."""
    return host_cpu()[0] / os.sysconf("SC_CLK_TCK")


def _cores(cpu: float, wall: float) -> float | None:
    return round(cpu / wall, 3) if wall > 0 else None


def _load(side: Side, prompts: list[Prompt], tokens: int, tok: Tokenizer, **kw: Any) -> LLMLoad:
    return LLMLoad(
        side.address,
        side.model,
        prompts,
        tokens,
        sampling=llm_serve.SAMPLING,
        tokenizer=tok,
        api=side.api,
        timeout=TIMEOUT_S,
        **kw,
    )


async def single_round(
    side: Side, opener: Prompt, prompt: Prompt, tokens: int, tok: Tokenizer
) -> dict:
    """The opener (1 token: the connection is open before the measured request), then one
    request of `tokens`: its TTFT and decode tokens/s after the first token."""
    load = _load(side, [opener, prompt], tokens, tok, duration=600, max_requests=2)
    rows = (await closed_loop(load, 1))["per_request"]
    return single_figures(rows[-1] if rows else {"error": "no request"})


def single_figures(row: dict) -> dict:
    ttft, e2e, n = row.get("ttft_ms"), row.get("e2e_ms"), row.get("completion_tokens") or 0
    if row.get("error") or ttft is None or e2e is None:
        return {"ttft_ms": None, "decode_tokens_per_s": None, "error": row.get("error")}
    seconds = (e2e - ttft) / 1000
    decode = (n - 1) / seconds if seconds > 0 and n > 1 else None
    return {
        "ttft_ms": round(ttft, 2),
        "decode_tokens_per_s": None if decode is None else round(decode, 1),
        "completion_tokens": n,
    }


async def level_round(
    side: Side, prompts: list[Prompt], streams: int, plan: llm_serve.Plan, tok: Tokenizer
) -> dict:
    load = _load(
        side,
        prompts,
        plan.load_tokens,
        tok,
        duration=plan.level_seconds,
        max_requests=2 * streams,
    )
    return await closed_loop(load, streams)


async def warm(side: Side, prompts: list[Prompt], streams: int, tok: Tokenizer) -> dict:
    """Unmeasured: one short request, then `streams` at once over prompts of every size."""
    await closed_loop(_load(side, prompts[:1], 4, tok, duration=120, max_requests=1), 1)
    load = _load(side, prompts, 8, tok, duration=120, max_requests=streams)
    return await closed_loop(load, streams)


def _summary(rounds: list[dict]) -> dict:
    return {
        "rounds": len(rounds),
        "ttft_ms": median([r["ttft_ms"] for r in rounds]),
        "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in rounds]),
        "each_round": rounds,
    }


async def measure(
    sides: Sequence[Side],
    plan: llm_serve.Plan,
    tok: Tokenizer,
    single_rounds: int,
    sizes: Sequence[int] = llm_serve.LOAD_SIZES,
    quiet: Callable[[], dict] | None = None,
) -> dict:
    """Every side in turn, round by round: warm-up, the single stream, each load level."""
    names = [s.name for s in sides]
    by = {s.name: s for s in sides}
    turns = Turns(sides)
    start_rss = {s.name: rss_tree_mb(s.pid) for s in sides}
    rss = {s.name: RssSampler(s.pid) for s in sides}
    singles: dict[str, list[dict]] = {n: [] for n in names}
    loads: dict[str, list[dict]] = {n: [] for n in names}
    with contextlib.ExitStack() as stack:
        for sampler in rss.values():
            stack.enter_context(sampler)
        warm_prompts = prompt_source.synthetic(list(sizes), tok, seed=7)
        for name in names:
            await turns.run("warm-up", -1, name, warm(by[name], warm_prompts, plan.levels[0], tok))
        before = await asyncio.to_thread(quiet) if quiet else None
        openers = prompt_source.synthetic([8] * single_rounds, tok, seed=3)
        short = prompt_source.synthetic([25] * single_rounds, tok, seed=1)
        for r in range(single_rounds):
            for name in order(names, r):
                job = single_round(by[name], _one(openers[r]), short[r], plan.decode_tokens, tok)
                singles[name].append(await turns.run("single", r, name, job))
        prompts = prompt_source.synthetic(list(sizes), tok, seed=2)
        for c in plan.levels:
            rounds: dict[str, list[dict]] = {n: [] for n in names}
            for r in range(plan.rounds):
                for name in order(names, r):
                    job = level_round(by[name], prompts, c, plan, tok)
                    rounds[name].append(await turns.run(f"c={c}", r, name, job))
            for n in names:
                loads[n].append(llm_serve.level(c, rounds[n]))
            print(f"c={c}", {n: loads[n][-1]["output_tokens_per_s"] for n in names})
    return {
        "sides": {
            n: {
                "single": _summary(singles[n]),
                "load": loads[n],
                "rss_mb": {"start": start_rss[n], **rss[n].report()},
            }
            for n in names
        },
        "idle_cpu": turns.report(),
        "turns": turns.log,
        "load_before": before,
    }


def _one(prompt: Prompt) -> Prompt:
    return Prompt(prompt.text, max_tokens=1)


# ---- the anchor: start every side, measure, judge -------------------------------------------


async def anchor(
    args: argparse.Namespace,
    gguf: Path,
    tok: Tokenizer,
    logs: Path,
    worker: tuple[str, int],
    quiet: Callable[[], dict],
) -> dict:
    """llama-server under each OMP wait policy (and n-gram setting) and the worker at
    `worker` (address, pid), all up at once and measured in interleaved rounds."""
    from benchmarks import llm_run

    plan = llm_serve.Plan(
        threads=args.threads,
        rounds=args.anchor_rounds,
        level_seconds=args.anchor_seconds,
        levels=tuple(args.levels),
    )
    specs = {"": ()} | (llm_serve.NGRAM_SERVER if args.speculative == "ngram" else {})
    out: dict = {
        "mode": "paired",
        "plan": {**plan.__dict__, "single_rounds": args.anchor_single_rounds, "settle_s": SETTLE_S},
        "llama_server_cpu_features": llm_serve.cpu_features(args.llama_server_bin, gguf),
        "spec_args": {},
    }
    sides = []
    async with contextlib.AsyncExitStack() as stack:
        for policy in args.llama_server_omp:
            for spec_name, spec in specs.items():
                name = f"{policy}, {spec_name}" if spec_name else policy
                server = llm_serve.llama_server(
                    args.llama_server_bin,
                    gguf,
                    plan,
                    logs / f"llama-server-{name.replace(', ', '-')}.log",
                    llm_run.omp_env(policy),
                    spec,
                )
                url, pid, argv = await stack.enter_async_context(server)
                out["llama_server_args"] = argv[1 : len(argv) - len(spec)]
                out["spec_args"][name] = list(spec)
                sides.append(Side(name, url, "openai", "smollm2", pid))
        sides.append(Side(WORKER, worker[0], "triton", args.model, worker[1]))
        measured = await measure(sides, plan, tok, args.anchor_single_rounds, quiet=quiet)
    out["meshserve"] = measured["sides"].pop(WORKER)
    out["llama_server_runs"] = measured.pop("sides")
    out.update(measured)
    out["meshserve_parameters"] = args.model_parameter
    out["checks"], out["reading"] = verdict(out["llama_server_runs"], out["meshserve"])
    out["reading"] += [drift_reading(out["llama_server_runs"], out["meshserve"], out["checks"])]
    out["reading"].append(idle_reading(out["idle_cpu"]))
    out["reading"].append(contention_reading(out["turns"]))
    return out


def spread(values: Sequence[float | None]) -> float | None:
    """max / min over the rounds: how far a figure moved while the code stayed the same."""
    have = [v for v in values if v]
    return round(max(have) / min(have), 2) if have else None


def drift_reading(servers: dict[str, dict], worker: dict, checks: dict) -> str:
    """How far each side's own figure moved over the rounds (max / min), next to how far
    their per-round ratio did: the drift that pairing takes out."""
    parts = []
    for name, (figures, _, _) in paired_targets(worker).items():
        c = checks[name]
        parts.append(
            f"{name.removesuffix('_vs_llama_server')}: llama-server {c['against']} "
            f"{spread(figures(servers[c['against']]))}x, the worker {spread(figures(worker))}x, "
            f"their per-round ratio {spread(c['rounds'])}x"
        )
    return "Spread over rounds (max / min): " + "; ".join(parts)


def contention_reading(turns: list[dict]) -> str:
    """How much CPU processes outside this run took during the measured turns."""
    measured = [t for t in turns if t["what"] != "warm-up" and t.get("others_cores") is not None]
    if not measured:
        return "CPU used outside this run: not recorded"
    wall = sum(t["wall_s"] for t in measured)
    mean = sum(t["others_cores"] * t["wall_s"] for t in measured) / wall
    busy = [t for t in measured if t["others_cores"] >= 0.25]
    worst = max(measured, key=lambda t: t["others_cores"])
    return (
        f"Processes outside this run used {mean:.2f} of the machine's cores over the measured "
        f"turns; {len(busy)} of {len(measured)} turns saw 0.25 or more (most: "
        f"{worst['others_cores']} in {worst['what']} round {worst['round']}, {worst['side']})"
    )


def idle_reading(idle: dict) -> str:
    parts = [
        f"{'the worker' if n == WORKER else 'llama-server ' + n} "
        f"{v['during_others_turns']['cores']} ({v['settle_after_own']['cores']} in the "
        f"{SETTLE_S} s after its own turns)"
        for n, v in idle.items()
    ]
    return "CPU cores used while another side was loaded: " + ", ".join(parts)
