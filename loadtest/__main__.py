"""python -m loadtest --address HOST:PORT --model NAME [--concurrency 1 8 32 | --rate 100 400]

Load for any KServe v2 gRPC endpoint (meshserve, Triton, MLServer). Requests are random
tensors shaped from the model's metadata (`--batch`, `--shape NAME=D1,D2`), arrays from
`--input-file` (.npz or .json), or `--text` for a text model. Each point warms up, then
measures for `--duration` seconds. Prints a live progress line and a table; `--output`
writes JSON (every percentile, errors by status code, the CDF), `--plot-dir` the PNGs.
`--llm` is the LLM mode over ModelStreamInfer: `python -m loadtest --llm --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from pathlib import Path

import grpc

from client.__main__ import API_KEY_VARIABLE
from client.client import Client
from common import tls
from loadtest import inputs, plots
from loadtest.runner import Load, closed_loop, measured, open_loop, progress_printer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--address", default="127.0.0.1:8001")
    parser.add_argument(
        "--ca", type=Path, help="TLS: trust this CA; an API key comes from MESHSERVE_API_KEY"
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-version", default="")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=int, nargs="+", help="closed loop; default 1")
    shape.add_argument("--rate", type=float, nargs="+", help="open loop, Poisson, req/s")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds a point")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each call")
    parser.add_argument("--max-requests", type=int, default=10_000_000, help="per point")
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="TCP connections to spread the calls over (a router of several processes)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--input-file", type=Path, help=".npz or .json inputs")
    source.add_argument("--text", nargs="+", help="one request per string (BYTES input)")
    parser.add_argument("--batch", type=int, default=1, help="for a -1 first dimension")
    parser.add_argument("--shape", action="append", default=[], help="NAME=D1,D2,...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-send-lag-ms",
        type=float,
        default=50.0,
        help="open loop: a send-lag p99 above this flags the run client-limited",
    )
    parser.add_argument(
        "--min-send-fraction",
        type=float,
        default=0.95,
        help="open loop: reaching under this fraction of the schedule flags it client-limited",
    )
    parser.add_argument("--output", type=Path, help="JSON results")
    parser.add_argument("--plot-dir", type=Path, help="latency_cdf.png, latency_vs_load.png")
    parser.add_argument("--label", default="", help="names the series in plots and JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.timeout <= 0:
        parser.error("--duration and --timeout must be > 0, --warmup >= 0")
    if not 0 < args.min_send_fraction <= 1 or args.max_send_lag_ms <= 0:
        parser.error("--min-send-fraction must be in (0, 1], --max-send-lag-ms > 0")
    if args.rate and min(args.rate) <= 0:
        parser.error("--rate must be > 0")
    return args


def connection(args: argparse.Namespace) -> tuple[grpc.ChannelCredentials | None, str | None]:
    """TLS credentials (--ca) and the API key (MESHSERVE_API_KEY, never a flag)."""
    credentials = tls.channel_credentials(args.ca) if args.ca else None
    return credentials, os.environ.get(API_KEY_VARIABLE)


def build_requests(args: argparse.Namespace) -> list[bytes]:
    credentials, key = connection(args)
    with Client(
        args.address, timeout=min(args.timeout, 30.0), credentials=credentials, api_key=key
    ) as client:
        meta = client.model_metadata(args.model, args.model_version)
    if args.input_file:
        arrays = inputs.from_file(args.input_file, meta)
    elif args.text:
        arrays = inputs.from_text(meta, args.text)
    else:
        shapes = inputs.parse_shapes(args.shape)
        arrays = inputs.from_metadata(meta, args.batch, shapes, seed=args.seed)
    return inputs.serialize(args.model, arrays, args.model_version)


async def run_all(args: argparse.Namespace, requests: list[bytes]) -> list[dict]:
    credentials, key = connection(args)
    load = Load(
        args.address,
        requests,
        args.duration,
        args.warmup,
        args.timeout,
        args.max_requests,
        min_send_fraction=args.min_send_fraction,
        max_send_lag_ms=args.max_send_lag_ms,
        credentials=credentials,
        metadata=(("authorization", f"Bearer {key}"),) if key else (),
        connections=args.connections,
    )
    progress = None if args.quiet else progress_printer()
    runs = []
    if args.rate:
        for rate in args.rate:
            runs.append(await open_loop(load, rate, seed=args.seed, progress=progress))
    else:
        for c in args.concurrency or [1]:
            runs.append(await closed_loop(load, c, progress=progress))
    return runs


def table(runs: list[dict]) -> str:
    lines = ["point            req/s     p50 ms   p90 ms   p99 ms  p99.9 ms  errors"]
    for r in runs:
        lines.append(
            f"{plots.label(r):15s} {r['throughput_rps']:8.1f} {r['p50_ms'] or 0:9.3f} "
            f"{r['p90_ms'] or 0:8.3f} {r['p99_ms'] or 0:8.3f} {r['p999_ms'] or 0:9.3f}  "
            f"{r['errors'] or '-'}" + ("  CLIENT-LIMITED" if r.get("client_limited") else "")
        )
    for r in runs:
        if r.get("client_limited"):
            lines.append(
                f"{plots.label(r)}: client-limited, the client fell behind its schedule "
                f"({r['client']['reason']}): its req/s and latency measure this client, "
                "not the server; use a lower rate or more client processes"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--llm" in argv and "--chaos" in argv:  # a worker killed mid-run (its own flags)
        from loadtest.llm import chaos

        return chaos.main(argv)
    if "--llm" in argv:
        from loadtest.llm import cli

        return cli.main(argv)
    args = parse_args(argv)
    requests = build_requests(args)
    runs = asyncio.run(run_all(args, requests))
    print(table(runs))
    name = args.label or f"{args.model}@{args.address}"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "label": name,
            "address": args.address,
            "model": args.model,
            "mode": "open" if args.rate else "closed",
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "client_python": platform.python_version(),
            "client_limited": any(r.get("client_limited") for r in runs),
            "runs": runs,
        }
        args.output.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.output}")
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        cdf = plots.latency_cdf(
            [(plots.label(r), r) for r in runs], args.plot_dir / "latency_cdf.png", name
        )
        vs = plots.latency_vs_load(
            {name: [measured(r) for r in runs]}, args.plot_dir / "latency_vs_load.png"
        )
        print(f"wrote {cdf} {vs}")
    return 1 if any(r["requests"] == 0 for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
