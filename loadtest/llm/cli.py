"""python -m loadtest --llm --model M (--prompts FILE | --prompt-len N) --max-tokens K
    [--concurrency 1 4 16 | --rate 0.5 2]
python -m loadtest --llm --model M --conversations N --turns K [--think-time S]
    (conversations on one system prompt, history resent: loadtest/llm/conversations.py)
python -m loadtest --llm --chaos --streams N --kill-pid PID --model M ... --max-tokens K
    (N streams at once, a worker killed mid-way: loadtest/llm/chaos.py)

LLM load over ModelStreamInfer with Triton's vLLM-backend tensors (text_input, stream,
sampling_parameters, exclude_input_in_output -> text_output): meshserve's engine, or
Triton's vLLM backend; or, with --api openai, over an OpenAI completions server's SSE
(llama.cpp's llama-server), timed the same way. Per request: TTFT (to the first non-empty
piece), inter-token latency, end-to-end latency, tokens/s; p50/p90/p99 from HDR histograms;
errors by gRPC code or stream error message. Tokens come from the server's usage
(final-response parameters prompt_tokens/completion_tokens, or num_*_tokens outputs with
--return-token-counts), else from --tokenizer; --count-tokens tokenizer re-tokenizes every
prompt and returned text instead, so two servers are counted alike. Each point warms up
(--warmup), starts requests for --duration seconds or --max-requests, then waits for those
in flight (each bounded by --timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from pathlib import Path

from client.__main__ import API_KEY_VARIABLE
from common import tls
from loadtest import plots
from loadtest.llm import prompts as prompt_source
from loadtest.llm import tenants
from loadtest.llm.runner import LLMLoad, closed_loop, open_loop
from loadtest.llm.stats import COUNTS
from loadtest.runner import measured, progress_printer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_server(parser.add_argument_group("server"))
    _add_prompts(parser.add_argument_group("prompts"))
    _add_generation(parser.add_argument_group("generation"))
    _add_load(parser.add_argument_group("load"))
    _add_output(parser.add_argument_group("output"))
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _add_server(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--llm", action="store_true", required=True, help="this mode")
    group.add_argument("--address", default="127.0.0.1:8001")
    group.add_argument(
        "--api",
        choices=("triton", "openai"),
        default="triton",
        help="triton: ModelStreamInfer (gRPC); openai: POST /v1/completions with SSE at "
        "--address (http://HOST:PORT), e.g. llama.cpp's llama-server",
    )
    group.add_argument(
        "--ca", type=Path, help="TLS: trust this CA; an API key comes from MESHSERVE_API_KEY"
    )
    group.add_argument("--model", required=True)
    group.add_argument("--model-version", default="")


def _add_prompts(group: argparse._ArgumentGroup) -> None:
    source = group.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", type=Path, help="one prompt a line, or .jsonl records")
    source.add_argument("--prompt-len", type=int, help="synthetic prompts of ~N tokens")
    group.add_argument("--prompt-len-stddev", type=float, default=0.0, help="vary lengths")
    group.add_argument("--num-prompts", type=int, default=64, help="synthetic prompts made")
    group.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json: exact synthetic lengths, and token counts when the server gives none",
    )
    group.add_argument(
        "--count-tokens",
        choices=COUNTS,
        default="server",
        help="server: the server's usage, else --tokenizer; tokenizer: always --tokenizer",
    )


def _add_generation(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-tokens", type=int, required=True)
    group.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate max_tokens every time (default on)",
    )
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--sampling", default="{}", help="more sampling_parameters, JSON")
    group.add_argument(
        "--return-token-counts",
        action="store_true",
        help="send return_num_input/output_tokens (Triton vLLM backend)",
    )


def _add_load(group: argparse._ArgumentGroup) -> None:
    shape = group.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=int, nargs="+", help="closed loop; default 1")
    shape.add_argument("--rate", type=float, nargs="+", help="open loop, Poisson, req/s")
    group.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME,KEY_VARIABLE,concurrency=C|rate=R[,after=S]",
        help="several tenants at once, each its API key (from the environment variable) and "
        "load, starting S seconds in; per-tenant TTFT and served tokens over one window, and "
        "Jain's index (loadtest/llm/tenants.py)",
    )
    group.add_argument("--duration", type=float, default=30.0, help="seconds starting requests")
    group.add_argument("--warmup", type=float, default=0.0, help="unmeasured seconds first")
    group.add_argument("--timeout", type=float, default=120.0, help="deadline of a request")
    group.add_argument("--max-requests", type=int, default=1000, help="per point")
    group.add_argument("--max-in-flight", type=int, default=1000, help="open loop")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--max-send-lag-ms",
        type=float,
        default=50.0,
        help="open loop: a send-lag p99 above this flags it client-limited",
    )
    group.add_argument(
        "--min-send-fraction",
        type=float,
        default=0.95,
        help="open loop: reaching under this share of arrivals flags it",
    )


def _add_output(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--output", type=Path, help="JSON results")
    group.add_argument("--plot-dir", type=Path, help="ttft_cdf.png, tokens_vs_load.png")
    group.add_argument("--label", default="", help="names the series in plots and JSON")
    group.add_argument("--quiet", action="store_true", help="no progress line")


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what argparse cannot: ranges, a tokenizer to count with, --sampling as a JSON
    object (parsed in place)."""
    if args.count_tokens == "tokenizer" and args.tokenizer is None:
        parser.error("--count-tokens tokenizer needs --tokenizer")
    if args.max_tokens < 1 or (args.prompt_len is not None and args.prompt_len < 1):
        parser.error("--max-tokens and --prompt-len must be >= 1")
    if args.duration <= 0 or args.warmup < 0 or args.timeout <= 0 or args.max_requests < 1:
        parser.error("--duration, --timeout, --max-requests must be > 0, --warmup >= 0")
    if not 0 < args.min_send_fraction <= 1 or args.max_send_lag_ms <= 0:
        parser.error("--min-send-fraction must be in (0, 1], --max-send-lag-ms > 0")
    if (args.rate and min(args.rate) <= 0) or (args.concurrency and min(args.concurrency) < 1):
        parser.error("--rate must be > 0, --concurrency >= 1")
    try:
        args.sampling = json.loads(args.sampling)
    except json.JSONDecodeError as e:
        parser.error(f"--sampling is not JSON: {e}")
    if not isinstance(args.sampling, dict):
        parser.error("--sampling must be a JSON object")
    try:
        args.tenant = [tenants.TenantLoad.parse(t) for t in args.tenant]
    except ValueError as e:
        parser.error(str(e))
    if args.tenant and (args.rate or args.concurrency):
        parser.error("--tenant sets each tenant's load: no --rate or --concurrency with it")


def build_load(args: argparse.Namespace) -> tuple[LLMLoad, dict]:
    tokenizer = prompt_source.load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.prompts:
        prompts = prompt_source.from_file(args.prompts)
        described: dict = {"source": str(args.prompts), "count": len(prompts)}
    else:
        sizes = prompt_source.lengths(
            args.prompt_len, args.prompt_len_stddev, args.num_prompts, args.seed
        )
        prompts = prompt_source.synthetic(sizes, tokenizer, args.seed)
        described = {
            "source": "synthetic (pydoc_data.topics)",
            "count": len(prompts),
            "target_tokens_mean": args.prompt_len,
            "target_tokens_stddev": args.prompt_len_stddev,
            "length_unit": "tokens" if tokenizer else "words x 1.3",
        }
    sampling = {"temperature": args.temperature, **args.sampling}
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    load = LLMLoad(
        args.address,
        args.model,
        prompts,
        args.max_tokens,
        sampling=sampling,
        version=args.model_version,
        duration=args.duration,
        warmup=args.warmup,
        timeout=args.timeout,
        max_requests=args.max_requests,
        tokenizer=tokenizer,
        return_token_counts=args.return_token_counts,
        min_send_fraction=args.min_send_fraction,
        max_send_lag_ms=args.max_send_lag_ms,
        credentials=tls.channel_credentials(args.ca) if args.ca else None,
        api_key=os.environ.get(API_KEY_VARIABLE),
        api=args.api,
        count_tokens=args.count_tokens,
    )
    return load, {**described, "sampling": {**sampling, "max_tokens": args.max_tokens}}


async def run_all(args: argparse.Namespace, load: LLMLoad) -> list[dict]:
    progress = None if args.quiet else progress_printer()
    runs = []
    if args.rate:
        for rate in args.rate:
            runs.append(
                await open_loop(load, rate, args.seed, args.max_in_flight, progress=progress)
            )
    else:
        for c in args.concurrency or [1]:
            runs.append(await closed_loop(load, c, progress=progress))
    return runs


def table(runs: list[dict]) -> str:
    lines = [
        "point            req/s   out tok/s  TTFT p50/p99 ms    ITL p50/p99 ms"
        "     e2e p50/p99 ms  stream tok/s p50  errors"
    ]
    for r in runs:
        ttft, itl, e2e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        lines.append(
            f"{plots.label(r):15s} {r['throughput_rps']:6.2f} {r['output_tokens_per_s']:10.1f}"
            f"  {ttft['p50'] or 0:7.1f}/{ttft['p99'] or 0:<8.1f}"
            f" {itl['p50'] or 0:6.1f}/{itl['p99'] or 0:<8.1f}"
            f" {e2e['p50'] or 0:8.1f}/{e2e['p99'] or 0:<9.1f}"
            f" {r['stream_tokens_per_s'].get('p50', 0):10.1f}      {r['errors'] or '-'}"
            + ("  CLIENT-LIMITED" if r.get("client_limited") else "")
        )
    for r in runs:
        shed = r["shed"]
        if shed["count"]:
            lines.append(
                f"{plots.label(r)}: shed {shed['count']} (overload), {shed['with_retry_after']} "
                f"with Retry-After; accepted TTFT p99 {r['ttft_ms']['p99'] or 0:.1f} ms"
            )
        if r["itl_unit"] != "token":
            lines.append(
                f"{plots.label(r)}: no token counts (no usage, no --tokenizer): "
                "ITL is per piece and tokens are pieces"
            )
        if r.get("client_limited"):
            lines.append(
                f"{plots.label(r)}: client-limited, the client fell behind its schedule "
                f"({r['client']['reason']}): its numbers measure this client, not the server"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--conversations" in argv:  # conversation / shared-prefix load (its own flags)
        from loadtest.llm import conversations

        return conversations.main(argv)
    args = parse_args(argv)
    try:
        load, described = build_load(args)
    except (OSError, ValueError) as e:
        print(f"python -m loadtest --llm: {e}", file=sys.stderr)
        return 2
    if args.tenant:
        return _tenants(args, load, described)
    runs = asyncio.run(run_all(args, load))
    print(table(runs))
    name = args.label or f"{args.model}@{args.address}"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "label": name,
            "address": args.address,
            "model": args.model,
            "llm": True,
            "mode": "open" if args.rate else "closed",
            "stream_per_request": True,
            "prompts": described,
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
        paths = [
            plots.latency_cdf(
                [(plots.label(r), r) for r in runs], args.plot_dir / "ttft_cdf.png", f"TTFT, {name}"
            )
        ]
        if len(runs) > 1:
            paths.append(
                plots.tokens_vs_load(
                    [measured(r) for r in runs], args.plot_dir / "tokens_vs_load.png", name
                )
            )
        print("wrote " + " ".join(str(p) for p in paths))
    return 1 if any(r["requests"] == 0 for r in runs) else 0


def _tenants(args: argparse.Namespace, load: LLMLoad, described: dict) -> int:
    progress = None if args.quiet else progress_printer()
    try:
        result = asyncio.run(
            tenants.run_tenants(load, args.tenant, args.seed, args.max_in_flight, progress)
        )
    except ValueError as e:  # a key variable unset
        print(f"python -m loadtest --llm: {e}", file=sys.stderr)
        return 2
    print(tenants.table(result))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "label": args.label or f"{args.model}@{args.address}",
            "address": args.address,
            "model": args.model,
            "llm": True,
            "mode": "tenants",
            "prompts": described,
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "tenant_loads": [vars(t) for t in args.tenant],
            **result,
        }
        args.output.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 1 if any(r["requests"] == 0 for r in result["tenants"].values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
