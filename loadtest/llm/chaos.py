"""The LLM mode's chaos load: N streams at once, and a worker killed mid-way.

    python -m loadtest --llm --chaos --streams 12 --kill-pid PID --model M \
        (--prompts FILE | --prompt-len N) --max-tokens K [--kill-signal KILL|TERM]
        [--kill-after-pieces 3] [--metrics-url http://ROUTER:PORT/metrics] [--reference]

Every stream sends one request (the prompts in turn) over its own ModelStreamInfer; once
each has `--kill-after-pieces` pieces the victim gets the signal (kill -9 by default), and
the round waits for every stream to end (each bounded by --timeout). Reported: streams
completed (their final response, no error), broken (an error), with the full token count
(completion_tokens = max_tokens; ignore_eos is on by default), the tokens received, and
with --metrics-url the streams the router migrated (its meshserve_router_migrations_total
before and after). --reference runs the same round without a kill first and counts the
streams whose text equals the uninterrupted one's (greedy: temperature 0).

As a library (benchmarks/migration.py): `chaos_round(load, streams, Kill(victim, ...))`,
where `victim` picks the pid at the moment of the kill (e.g. the busiest worker).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loadtest.llm import cli
from loadtest.llm.runner import LLMLoad
from loadtest.llm.stream import Outcome, Streams

MIGRATIONS = "meshserve_router_migrations_total"
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}


@dataclass(frozen=True)
class Kill:
    victim: Callable[[], int]  # the pid to signal, chosen at the moment of the kill
    signal: int = signal.SIGKILL
    after_pieces: int = 3  # every stream has this many pieces first


def migrations(metrics_url: str | None) -> float | None:
    """The router's migrations so far (all models), None without a metrics URL."""
    if metrics_url is None:
        return None
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(MIGRATIONS))


async def chaos_round(
    load: LLMLoad, streams: int, kill: Kill | None = None, metrics_url: str | None = None
) -> dict:
    """`streams` requests at once; with `kill`, the victim signalled mid-way. The report,
    with each stream's outcome under "outcomes" (its text, counts and error)."""
    requests = load.requests()
    client = Streams(load.address, load.credentials, load.api_key)
    loop = asyncio.get_running_loop()
    pieces = [0] * streams
    before = migrations(metrics_url)
    t0 = loop.time()

    def counter(i: int) -> Callable[[], None]:
        def on_piece() -> None:
            pieces[i] += 1

        return on_piece

    tasks = [
        asyncio.ensure_future(
            client.generate(
                requests[i % len(requests)][0],  # type: ignore[arg-type]  # triton wire
                t0,
                load.timeout,
                loop.time,
                counter(i),
            )
        )
        for i in range(streams)
    ]
    killed = None
    try:
        if kill is not None:
            killed = await _kill(kill, pieces, tasks, t0 + load.timeout)
            killed["at_s"] = round(loop.time() - t0, 3)
        outcomes = await asyncio.gather(*tasks)
    finally:
        await client.close()
    after = migrations(metrics_url)
    moved = None if before is None or after is None else int(after - before)
    maxima = [p.max_tokens or load.max_tokens for p in load.prompts]
    wanted = [maxima[i % len(maxima)] for i in range(streams)]
    return {**summary(outcomes, wanted), "killed": killed, "migrated": moved}


async def _kill(kill: Kill, pieces: list[int], tasks: list[asyncio.Task], deadline: float) -> dict:
    """Wait until every stream has its pieces (or one ended, or the deadline), then kill."""
    loop = asyncio.get_running_loop()
    while (
        min(pieces) < kill.after_pieces
        and not any(t.done() for t in tasks)
        and loop.time() < deadline
    ):
        await asyncio.sleep(0.01)
    pid = kill.victim()
    os.kill(pid, kill.signal)
    return {"pid": pid, "signal": signal.Signals(kill.signal).name, "pieces_before": sum(pieces)}


def summary(outcomes: list[Outcome], wanted: list[int]) -> dict:
    """Streams completed, broken, with their full token count; the tokens they received."""
    done = [o.error is None for o in outcomes]
    return {
        "streams": len(outcomes),
        "completed": sum(done),
        "broken": len(outcomes) - sum(done),
        "full_token_count": sum(
            ok and o.completion_tokens == w for ok, o, w in zip(done, outcomes, wanted, strict=True)
        ),
        "prompt_tokens_received": sum(o.prompt_tokens or 0 for o in outcomes),
        "completion_tokens_received": sum(o.completion_tokens or 0 for o in outcomes),
        "errors": dict(Counter(o.error for o in outcomes if o.error is not None)),
        "seconds": round(max(o.end for o in outcomes) - min(o.start for o in outcomes), 3),
        "outcomes": [
            {"text": o.text, "completion_tokens": o.completion_tokens, "error": o.error}
            for o in outcomes
        ],
    }


def same_text(reference: dict, run: dict) -> int:
    """Streams of `run` whose text equals the reference round's (stream by stream)."""
    pairs = zip(reference["outcomes"], run["outcomes"], strict=True)
    return sum(r["text"] == o["text"] and not r["error"] and not o["error"] for r, o in pairs)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest --llm --chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli._add_server(parser.add_argument_group("server"))
    cli._add_prompts(parser.add_argument_group("prompts"))
    cli._add_generation(parser.add_argument_group("generation"))
    cli._add_load(parser.add_argument_group("load (--timeout, --seed)"))
    chaos = parser.add_argument_group("chaos")
    chaos.add_argument("--chaos", action="store_true", required=True, help="this mode")
    chaos.add_argument("--streams", type=int, default=12, help="streams at once")
    chaos.add_argument("--kill-pid", type=int, required=True, help="the worker to kill")
    chaos.add_argument("--kill-signal", choices=sorted(SIGNALS), default="KILL")
    chaos.add_argument("--kill-after-pieces", type=int, default=3, help="per stream, first")
    chaos.add_argument("--metrics-url", help="the router's /metrics: count its migrations")
    chaos.add_argument("--reference", action="store_true", help="a round without a kill first")
    chaos.add_argument("--output", type=Path, help="JSON results")
    args = parser.parse_args(argv)
    cli._check(parser, args)
    if args.streams < 1 or args.kill_after_pieces < 0:
        parser.error("--streams must be >= 1, --kill-after-pieces >= 0")
    return args


async def run(args: argparse.Namespace, load: LLMLoad) -> dict:
    result: dict = {}
    if args.reference:
        result["reference"] = await chaos_round(load, args.streams, None, args.metrics_url)
    kill = Kill(lambda: args.kill_pid, SIGNALS[args.kill_signal], args.kill_after_pieces)
    result["chaos"] = await chaos_round(load, args.streams, kill, args.metrics_url)
    if args.reference:
        result["chaos"]["same_text_as_reference"] = same_text(result["reference"], result["chaos"])
    return result


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        load, described = cli.build_load(args)
    except (OSError, ValueError) as e:
        print(f"python -m loadtest --llm --chaos: {e}", file=sys.stderr)
        return 2
    result = asyncio.run(run(args, load))
    c = result["chaos"]
    print(
        f"streams {c['streams']}  completed {c['completed']}  broken {c['broken']}  "
        f"full token count {c['full_token_count']}  migrated {c['migrated']}  "
        f"same text {c.get('same_text_as_reference', '-')}  errors {c['errors'] or '-'}"
    )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"prompts": described, **result}, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0 if c["completed"] == c["streams"] else 1
