"""python -m devmesh.models --output DIR: the repository the mesh serves, each model built once
(skipped while DIR/<model>/config.pbtxt exists): the toy models, MiniLM fp32 + int8 and
SmolLM2-135M int8 + int4 for the LLM engine (`build-llm --by-cpu`: a worker serves int8 on a
CPU with VNNI, int4 on one without), each quantized model behind its accuracy gate.

`make run` (devmesh/launch.py) and the compose stack's `models` service run it. A real model
that fails to build is reported and left out; the toy models are always there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from devmesh import toy_models

ROOT = Path(__file__).resolve().parents[1]


def build(repository: Path) -> None:
    if not (repository / "mlp" / "config.pbtxt").exists():
        print(f"building the toy model repository in {repository}", flush=True)
        toy_models.build(repository)
    if not (repository / "minilm" / "config.pbtxt").exists():
        print(f"building MiniLM fp32 + int8 into {repository}/minilm (once, ~30 s)", flush=True)
        _quantize(
            "MiniLM",
            "build-repository",
            "--output",
            str(repository),
            "--model",
            "minilm",
            "--recipe",
            "encoder-int8-dynamic",
        )
    if not (repository / "smollm2" / "config.pbtxt").exists():
        print(
            f"building SmolLM2 int8 + int4 for the LLM engine into {repository}/smollm2 (once, "
            "~4 min; the worker serves the one for its CPU)"
        )
        _quantize("SmolLM2", "build-llm", "--output", str(repository), "--by-cpu")


def _quantize(label: str, *args: str) -> None:
    if subprocess.run([sys.executable, "-m", "quantize", *args], cwd=ROOT).returncode != 0:
        print(f"{label} was not built (see above); serving without it", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devmesh.models", description=__doc__)
    parser.add_argument("--output", type=Path, required=True, help="the model repository")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    build(parse_args(sys.argv[1:] if argv is None else argv).output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
