"""python -m planner probe | calibrate | diagnose | plan | validate

python -m planner probe [--output build/planner/profile.json] [--mesh]
python -m planner calibrate --model M [--model-repository DIR] [--version V] [--max-batch B]
                            [--profile local] [--output FILE]
python -m planner diagnose --model-repository DIR --profile P [--batch 1 8 64] [--context C]
                           [--concurrency N] [--plot roofline.png] [--json]
python -m planner plan --model M --qps Q --p99-ms L [--context C --max-tokens K] --profile P
                       --price-per-hour H [--model-repository DIR] [--json]
python -m planner validate [--seconds 5] [--skip-llm] [--reanalyse] [--results DIR]

A profile is H200, H100, A100, L4, `local` (what `probe` wrote) or a profile JSON file.
`calibrate` serves one encoder version through a one-worker mesh on this machine and writes the
local profile fitted to it (planner/serving.py), for `plan --profile FILE --recipe R`.
`validate` predicts, then measures, each checked configuration through router + workers on
this machine and writes benchmarks/results/planner.json (planner/validate/).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from common import cli, logging, paths
from perfmodel import profiles
from perfmodel.analysis import DECODER, AnalysisError, analyse_repository
from perfmodel.roofline import diagnose
from planner import probe as probing
from planner.models import model_versions, prices, with_recipes
from planner.plan import Plan, Workload, plan
from planner.plot import roofline_png
from planner.serving import calibrate_serving, served_profile
from planner.validate.configs import ValidateSettings


def _probe(args: argparse.Namespace) -> int:
    profile = probing.probe(args.seconds)
    if args.mesh:
        with tempfile.TemporaryDirectory() as tmp:
            overhead = probing.mesh_overhead(Path(tmp), args.seconds)
        profile = profiles.Profile(**{**profile.as_dict(), **overhead})
    path = profiles.save(profile, Path(args.output))
    print(json.dumps(profile.as_dict(), indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    versions = model_versions(Path(args.model_repository), args.model)
    version = args.version or versions[-1].version
    m = next((v for v in versions if v.version == version), None)
    if m is None:
        known = [v.version for v in versions]
        raise AnalysisError(f"{args.model!r} has no version {version!r} (versions: {known})")
    if m.kind == DECODER:
        raise AnalysisError(
            f"{args.model!r} is an LLM: its engine batches every step, which a serving "
            "calibration of whole calls does not fit; its decode steps are timed by "
            "planner/calibrate.py"
        )
    base = profiles.load(args.profile)
    top = args.max_batch or m.max_batch_size or 8
    path = Path(args.model_repository) / args.model / version / "model.onnx"
    tokens = m.default_tokens
    served = calibrate_serving(path, args.model, (1, top), tokens, args.seconds)
    profile = served_profile(base, served, m, top, tokens)
    out = Path(args.output or paths.build("planner", f"{args.model}-v{version}-served.json"))
    profiles.save(profile, out)
    print(json.dumps(served.as_dict(), indent=2))
    print(f"wrote {out}: plan with --profile {out} --recipe {m.recipe}", file=sys.stderr)
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    profile = profiles.load(args.profile)
    analyses = analyse_repository(Path(args.model_repository))
    rows = []
    points = []
    for m in analyses:
        for b in args.batch:
            if m.max_batch_size and b > m.max_batch_size and m.kind != DECODER:
                continue
            context = args.context if m.kind == DECODER else 0
            d = diagnose(m, profile, b, context, concurrency=args.concurrency)
            points.append(d)
            rows.append({**d.row(), "help": d.help})
    if args.json:
        body = {"profile": profile.as_dict(), "models": [m.summary() for m in analyses]}
        print(json.dumps({**body, "diagnosis": rows}, indent=2))
    else:
        print(f"profile {profile.name}: {profile.source}")
        for dtype in ("fp32", "int8"):
            print(f"  ridge point {dtype}: {profile.ridge(dtype):.1f} FLOP/byte")
        for m in analyses:
            s = m.summary(args.context if m.kind == DECODER else 0)
            print(
                f"{m.name} v{m.version} {m.recipe}: weights {m.weight_bytes / 1e6:.1f} MB, "
                f"{m.projection_params / 1e6:.1f} M projection params"
                + (f", KV {m.kv_bytes_per_token} B/token" if m.kv_bytes_per_token else "")
                + f", intensity by batch {s['intensity_by_batch']}"
            )
        header = f"{'model':<10} {'recipe':<26} {'batch':>5} {'FLOP/B':>8} {'ridge':>7} "
        header += f"{'time ms':>9} {'resident MB':>11}  bound"
        print(header)
        for r in rows:
            print(
                f"{r['model']:<10} {r['recipe']:<26} {r['batch']:>5} {r['intensity']:>8} "
                f"{r['ridge']:>7} {r['time_ms']:>9} {r['resident_MB']:>11}  {r['bound']}"
            )
        for bound, advice in sorted({(r["bound"], r["help"]) for r in rows}):
            print(f"  {bound}-bound -> {advice}")
    if args.plot:
        print(f"wrote {roofline_png(profile, points, Path(args.plot))}", file=sys.stderr)
    return 0


def _print_plan(p: Plan) -> None:
    w = p.workload
    print(f"plan for {p.model} on {p.profile}: {w.qps:g} calls/s, p99 <= {w.p99_s * 1e3:g} ms")
    print(f"queueing model: {p.queueing}")
    if p.best is None:
        print("no configuration meets the SLO; the closest:")
    else:
        b = p.best
        print(
            f"cheapest: {b.replicas} replica(s) x TP {b.tp} x {b.recipe} x max batch "
            f"{b.max_batch}: p99 {b.prediction.p99_s * 1e3:.2f} ms, capacity "
            f"{b.prediction.capacity_rps:,.0f}/s, ${b.cost_per_hour_usd:.2f}/hour"
        )
        e = p.economics
        line = f"  cost per call ${e['cost_per_call_usd']:.8f}"
        if "cost_per_1k_output_tokens_usd" in e:
            line += f", per 1k output tokens ${e['cost_per_1k_output_tokens_usd']:.6f}"
        print(line)
        print(f"  {e['statement']}")
    for c in p.runners_up:
        r = c.row()
        verdict = c.why
        if c.meets and p.best is not None:
            extra = c.cost_per_hour_usd - p.best.cost_per_hour_usd
            verdict = (
                f"meets it too, ${extra:.2f}/hour more"
                if extra > 0
                else "meets it too at the same cost, with a higher p99 or a larger batch"
            )
        print(
            f"  {r['replicas']} x TP {r['tp']} x {r['recipe']} x batch {r['max_batch']}: "
            f"${r['cost_per_hour_usd']}/h, p99 {r['p99_ms'] or '-'} ms: {verdict}"
        )


def _plan(args: argparse.Namespace) -> int:
    profile = profiles.load(args.profile)
    repository = Path(args.model_repository)
    analyses = with_recipes(model_versions(repository, args.model))
    if args.recipe:
        analyses = [a for a in analyses if a.recipe in args.recipe]
        if not analyses:
            raise AnalysisError(f"none of the recipes {args.recipe} apply to {args.model!r}")
    if analyses[0].kind == DECODER and args.max_tokens <= 0:
        raise AnalysisError(f"{args.model!r} is an LLM: give --max-tokens K (and --context C)")
    w = Workload(args.qps, args.p99_ms / 1e3, args.context, args.max_tokens)
    result = plan(analyses, profile, w, prices(repository, args.model, args.price_per_hour))
    if args.json:
        body = {
            "model": result.model,
            "profile": result.profile,
            "queueing": result.queueing,
            "best": result.best.row() if result.best else None,
            "economics": result.economics,
            "runners_up": [c.row() for c in result.runners_up],
        }
        print(json.dumps(body, indent=2))
    else:
        _print_plan(result)
    return 0 if result.best is not None else 1


def _validate(args: argparse.Namespace) -> int:
    settings = cli.from_args(ValidateSettings, args)
    from planner.validate.run import validate  # the mesh, the load tool, quantize: on demand

    validate(settings)
    return 0


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m planner", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe", help="measure this machine into a profile file")
    pr.add_argument("--output", default=str(profiles.default_probed()))
    pr.add_argument("--seconds", type=_positive(float), default=3.0, help="budget per measure")
    pr.add_argument("--mesh", action="store_true", help="also measure the mesh's cost per call")
    c = sub.add_parser("calibrate", help="fit the local profile to one model as served")
    c.add_argument("--model", required=True)
    c.add_argument("--model-repository", default=str(paths.build("models")))
    c.add_argument("--version", help="default: the newest")
    c.add_argument("--max-batch", type=_positive(int), help="default: the model's own")
    c.add_argument("--profile", default="local")
    c.add_argument("--seconds", type=_positive(float), default=3.0, help="per batch limit")
    c.add_argument("--output", help="default: build/planner/<model>-v<version>-served.json")
    d = sub.add_parser("diagnose", help="which resource is the limit, per model and batch")
    d.add_argument("--model-repository", required=True)
    d.add_argument("--profile", required=True)
    d.add_argument("--batch", type=_positive(int), nargs="+", default=[1, 8, 64])
    d.add_argument("--context", type=int, default=512, help="an LLM's tokens in the cache")
    d.add_argument("--concurrency", type=_positive(int), help="sequences whose KV must fit")
    d.add_argument("--plot", help="write the Roofline plot (PNG) here")
    d.add_argument("--json", action="store_true")
    pl = sub.add_parser("plan", help="the cheapest configuration for an SLO")
    pl.add_argument("--model", required=True)
    pl.add_argument("--model-repository", default=str(paths.build("models")))
    pl.add_argument("--qps", type=_positive(float), required=True)
    pl.add_argument("--p99-ms", type=_positive(float), required=True)
    pl.add_argument("--context", type=int, default=0, help="prompt tokens (LLM) / item tokens")
    pl.add_argument("--max-tokens", type=int, default=0, help="an LLM's generated tokens")
    pl.add_argument("--profile", required=True)
    pl.add_argument(
        "--price-per-hour", type=_positive(float), required=True, help="USD per device-hour"
    )
    pl.add_argument("--recipe", nargs="+", help="only these recipes")
    pl.add_argument("--json", action="store_true")
    v = sub.add_parser(
        "validate",
        help="the predictions against this machine's mesh (benchmarks/results/planner.json)",
        description="Predict, then measure, each checked configuration through router + "
        "workers on this machine (planner/validate/). Every flag can also be set as "
        "MESHSERVE_PLANNER_VALIDATE_<FLAG>.",
    )
    cli.add_flags(v, ValidateSettings)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.configure("warning")
    commands = {
        "probe": _probe,
        "calibrate": _calibrate,
        "diagnose": _diagnose,
        "plan": _plan,
        "validate": _validate,
    }
    try:
        return commands[args.command](args)
    except (AnalysisError, profiles.ProfileError, ValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
