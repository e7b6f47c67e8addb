"""python -m quantize export | quantize | evaluate | build-repository

    export            real weights -> CACHE/<model>/fp32/{model.onnx,tokenizer.json}
    shard             real weights -> tensor-parallel shard sets OUTPUT/<model>/1/tp<N>/
                      (--tp 2 3; a size that does not divide the heads is refused)
    quantize          CACHE/<model>/fp32 -> CACHE/<model>/<recipe>
    evaluate          gate CACHE/<model>/<recipe> against fp32; report in REPORTS/<model>/;
                      exit 1 when the gate refuses it
    distill           a student of the teacher with --layers K of its layers, trained here
                      (--steps S; resumable), exported, int8 on top, both gated against
                      the fp32 teacher and the accepted ones added to OUTPUT/<model>/ as
                      further versions; exit 1 when the gate refuses either
    build-repository  all of the above for every model and recipe asked for, then a Triton
                      repository OUTPUT/<model>/{1 = fp32, 2.. = accepted recipes}; exit 1
                      when any recipe was refused (the accepted ones are still installed)

Exit 2: bad input (unknown model or recipe, missing weights package, failed export).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from common import paths
from quantize import pipeline, repository
from quantize.recipes import RECIPES, distill_recipe

console = Console(stderr=True)
# a recipe build's graph caches float32 (quantize/pipeline.py exports it so); a float16 cache
# (llama.cpp's, and what onnxruntime's CUDA attention takes) is a checkpoint's, as stored
KV_DTYPE_REFUSED = (
    "--kv-dtype {}: the SmolLM2 recipes build their step graph with a float32 KV cache; a "
    "float16 cache is built from a checkpoint as stored: --checkpoint FILE --kv-dtype float16 "
    "(SmolLM2's own GGUF: python -c 'from quantize import weights; print(weights.smollm2_gguf())')"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m quantize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cache", type=Path, default=paths.build("quantize"))
    parser.add_argument("--reports", type=Path, default=paths.build("quantize", "reports"))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export")
    p.add_argument("--model", nargs="+", default=list(pipeline.SOURCES))
    p.add_argument("--force", action="store_true")
    for name in ("quantize", "evaluate"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--recipe", required=True, help=f"one of {sorted(RECIPES)}")
    p = sub.add_parser("shard", help="tensor-parallel shard sets (quantize/shard.py)")
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, nargs="+", required=True)
    p.add_argument("--output", type=Path, default=paths.build("repository"))
    p.add_argument("--layers", type=int, help="keep only the first N layers (quick checks)")
    p.add_argument("--name", help="the served model name (default: --model)")
    p = sub.add_parser(
        "build-llm", help="SmolLM2 as the LLM engine's step graph, gated, into a repository"
    )
    p.add_argument("--output", type=Path, default=paths.build("repository"))
    p.add_argument("--recipe", default="decoder-int8-weight-only", help="a decoder recipe or fp32")
    p.add_argument("--name", default="smollm2", help="the served model name")
    p.add_argument("--max-model-len", type=int, help="default: 2048 (SmolLM2); a checkpoint's own")
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="any llama / qwen2 GGUF file or Hugging Face folder, served as stored",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["float32", "float16"],
        help="the KV cache's type, with --checkpoint (default float32); the SmolLM2 recipes' "
        "graphs cache float32",
    )
    p.add_argument(
        "--no-custom-op",
        action="store_true",
        help="with --checkpoint: GGUF blocks as onnxruntime's MatMulNBits only, not "
        "meshserve's CPU op MatMulQ (for a GPU, or a worker without `make ops`)",
    )
    p.add_argument(
        "--by-cpu",
        action="store_true",
        help="also the int4 graph, served on CPUs without VNNI (quantize/llm.py BY_CPU)",
    )
    p = sub.add_parser("distill", help="a smaller student of the teacher (quantize/distill.py)")
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, required=True, help="the student's layers (K)")
    p.add_argument("--steps", type=int, help="training steps (default: the model's plan)")
    p.add_argument(
        "--generated-per-topic",
        type=int,
        help="training sentences SmolLM2 writes per topic (default 8; 0: reference text only)",
    )
    p.add_argument("--output", type=Path, default=paths.build("repository"))
    p = sub.add_parser("build-repository")
    p.add_argument("--output", type=Path, default=paths.build("repository"))
    p.add_argument("--model", nargs="+", default=list(pipeline.SOURCES))
    p.add_argument("--recipe", nargs="+", help="default: each model's recipes")
    return parser.parse_args(argv)


def progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def show_verdict(v: pipeline.Verdict) -> None:
    if v.accepted:
        console.print(f"[green]accepted[/green] {v.model}/{v.recipe.name}: " + _brief(v.metrics))
    else:
        console.print(f"[red]REFUSED[/red] {v.model}/{v.recipe.name}: " + "; ".join(v.failures))


def _brief(metrics: dict) -> str:
    return ", ".join(f"{k} {val:.4f}" for k, val in metrics.items())


def training_progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.5f}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def distill(args: argparse.Namespace) -> int:
    """Train (or reuse) the student, int8 on top, gate both, add the accepted ones."""
    model = pipeline.source(args.model)
    if args.layers < 1:
        raise pipeline.BuildError(f"--layers {args.layers}: a student needs at least 1 layer")
    if args.steps is not None and args.steps < 0:
        raise pipeline.BuildError(f"--steps {args.steps}: expected a count >= 0")
    names = [distill_recipe(model.kind, args.layers, int8).name for int8 in (False, True)]
    with training_progress() as bar:
        text = bar.add_task("training text (once)", total=None, loss=0.0)
        train = bar.add_task(f"distill {args.model} -> {args.layers} layers", total=1, loss=0.0)

        def on_step(done: int, total: int, loss: float) -> None:
            bar.update(train, completed=done, total=total, loss=loss)

        student = pipeline.distill_model(
            args.model,
            args.layers,
            args.cache,
            args.steps,
            on_step,
            lambda: bar.advance(text),
            args.generated_per_topic,
        )
        bar.update(text, total=1, completed=1)
    console.print(f"student: {student.model}")
    verdicts = []
    with progress() as bar:
        # the gate's reference: the fp32 teacher (exported now on a fresh cache)
        step(bar, f"export {args.model}", pipeline.export_model, args.model, args.cache)
        step(
            bar,
            f"int8 on {names[0]}",
            pipeline.quantize_model,
            args.model,
            names[1],
            args.cache,
            False,
            args.steps,
        )
        for name in names:
            verdict = evaluate_with_bar(bar, args.model, name, args)
            show_verdict(verdict)
            verdicts.append(verdict)
    accepted = [v.recipe.name for v in verdicts if v.accepted]
    for v in verdicts:
        console.print(f"report: {args.reports / args.model / v.recipe.name}.md")
    if accepted:
        versions = repository.add_versions(args.model, accepted, args.cache, args.output)
        console.print(
            f"{args.output / args.model}: " + ", ".join(f"{v}={lab}" for v, lab in versions.items())
        )
    else:
        console.print(f"[red]nothing added to {args.output / args.model}[/red]")
    return 0 if len(accepted) == len(verdicts) else 1


def evaluate_with_bar(bar: Progress, model: str, recipe: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from quantize.evaluate import load_set

    kind = pipeline.source(model).kind
    total = len(load_set(kind)["prompts"]) if kind == "decoder" else 1
    task = bar.add_task(f"evaluate {model}/{recipe}", total=total)
    verdict = pipeline.evaluate_model(
        model, recipe, args.cache, args.reports, lambda: bar.advance(task)
    )
    bar.update(task, completed=total)
    return verdict


def step(bar: Progress, label: str, fn, *a):  # type: ignore[no-untyped-def]
    task = bar.add_task(label, total=1)
    result = fn(*a)
    bar.update(task, completed=1)
    return result


def run(args: argparse.Namespace) -> int:
    if args.command == "export":
        with progress() as bar:
            for m in args.model:
                a = step(bar, f"export {m}", pipeline.export_model, m, args.cache, args.force)
                console.print(f"{m}: {a.model}")
        return 0
    if args.command == "quantize":
        with progress() as bar:
            step(bar, f"export {args.model}", pipeline.export_model, args.model, args.cache)
            a = step(
                bar,
                f"quantize {args.model}/{args.recipe}",
                pipeline.quantize_model,
                args.model,
                args.recipe,
                args.cache,
            )
        console.print(f"{args.model}/{args.recipe}: {a.model} (not gated yet: run evaluate)")
        return 0
    if args.command == "shard":
        from quantize.shard import ShardError
        from quantize.sharding import shard_model

        try:
            for path in shard_model(
                args.model, args.tp, args.output, args.layers, serve_as=args.name
            ):
                console.print(f"{args.model}: {path}")
        except ShardError as e:
            console.print(f"[red]error:[/red] {e}")
            return 2
        return 0
    if args.command == "build-llm":
        from quantize import llm
        from quantize.checkpoint import CheckpointError

        if args.checkpoint is not None:
            try:
                path = llm.build_checkpoint(
                    args.checkpoint,
                    args.output,
                    args.name,
                    args.max_model_len,
                    args.kv_dtype or "float32",
                    custom_op=False if args.no_custom_op else None,
                )
            except CheckpointError as e:
                console.print(f"[red]refused:[/red] {e}")
                return 2
            console.print(f"{args.name}: {path}")
            return 0
        if args.kv_dtype not in (None, "float32"):
            console.print(f"[red]refused:[/red] {KV_DTYPE_REFUSED.format(args.kv_dtype)}")
            return 2
        with progress() as bar:
            path, metrics = step(
                bar,
                f"smollm2/{args.recipe} for the LLM engine",
                llm.build,
                args.output,
                args.recipe,
                args.cache,
                args.name,
                args.reports,
                args.max_model_len or 2048,
                llm.BY_CPU if args.by_cpu else (),
            )
        if metrics:
            console.print(f"{args.recipe}: {metrics}")
        console.print(f"{args.name}: {path}")
        return 0
    if args.command == "distill":
        return distill(args)
    if args.command == "evaluate":
        with progress() as bar:
            verdict = evaluate_with_bar(bar, args.model, args.recipe, args)
        show_verdict(verdict)
        console.print(f"report: {args.reports / args.model / args.recipe}.md")
        return 0 if verdict.accepted else 1
    return build_repository(args)


def build_repository(args: argparse.Namespace) -> int:
    models = [pipeline.source(m) for m in args.model]
    chosen = {r: pipeline.recipe_named(r) for r in args.recipe or []}
    plan = {
        m.name: [r for r in args.recipe if chosen[r].kind == m.kind]
        if args.recipe
        else list(m.recipes)
        for m in models
    }
    verdicts: list[pipeline.Verdict] = []
    versions: dict[str, dict[int, str]] = {}
    with progress() as bar:
        for model, recipes in plan.items():
            step(bar, f"export {model}", pipeline.export_model, model, args.cache)
            for recipe in recipes:
                step(
                    bar,
                    f"quantize {model}/{recipe}",
                    pipeline.quantize_model,
                    model,
                    recipe,
                    args.cache,
                )
                verdict = evaluate_with_bar(bar, model, recipe, args)
                show_verdict(verdict)
                verdicts.append(verdict)
            accepted = [v.recipe.name for v in verdicts if v.model == model and v.accepted]
            versions[model] = step(
                bar,
                f"install {model} into {args.output}",
                repository.install_model,
                model,
                accepted,
                args.cache,
                args.output,
            )
    body = pipeline.summary(verdicts, versions)
    pipeline.write_summary(args.reports, body)
    for model, vs in versions.items():
        console.print(f"{args.output / model}: " + ", ".join(f"{v}={lab}" for v, lab in vs.items()))
    console.print(f"reports: {args.reports}")
    refused = body["refused"]
    for key, failures in refused.items():
        console.print(f"[red]refused[/red] {key}: " + "; ".join(failures))
    return 1 if refused else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except pipeline.BuildError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
