"""The load tool's chaos mode: its counts as units, then the CLI against a real SmolLM2
worker that it kills -9 mid-round (straight to the worker: no router to move the streams,
so every one breaks and the tool says so)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.llm.chaos import same_text, summary
from loadtest.llm.stream import Outcome
from tests.conftest import start_worker

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"


def outcome(text: str, completion: int, error: str | None = None) -> Outcome:
    return Outcome(0.0, 1.0, text=text, prompt_tokens=5, completion_tokens=completion, error=error)


def test_a_rounds_counts_and_its_texts_against_the_reference() -> None:
    reference = summary([outcome("a", 4), outcome("b", 4), outcome("c", 4)], [4, 4, 4])
    run = summary([outcome("a", 4), outcome("b!", 4), outcome("c", 2, "UNAVAILABLE")], [4, 4, 4])
    assert (run["completed"], run["broken"], run["full_token_count"]) == (2, 1, 2)
    assert run["prompt_tokens_received"] == 15 and run["completion_tokens_received"] == 10
    assert run["errors"] == {"UNAVAILABLE": 1}
    assert same_text(reference, run) == 1


@pytest.mark.slow
def test_cli_kills_the_worker_mid_round_and_counts_the_broken_streams(
    tmp_path: Path,
) -> None:
    from quantize import llm

    llm.build(tmp_path / "repo", llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
    worker = start_worker(tmp_path / "repo", tmp_path)
    out = tmp_path / "chaos.json"
    try:
        args = ["--llm", "--chaos", "--address", worker.address, "--model", MODEL]
        args += ["--prompt-len", "16", "--max-tokens", "200", "--streams", "3", "--reference"]
        args += ["--kill-pid", str(worker.process.pid), "--kill-after-pieces", "2"]
        args += ["--timeout", "120", "--output", str(out)]
        proc = subprocess.run(
            [sys.executable, "-m", "loadtest", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        worker.process.kill()
        worker.process.wait(10)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # not every stream completed
    result = json.loads(out.read_text())
    ref, chaos = result["reference"], result["chaos"]
    assert (ref["completed"], ref["full_token_count"], ref["killed"]) == (3, 3, None)
    assert chaos["killed"]["pid"] == worker.process.pid
    assert chaos["killed"]["signal"] == "SIGKILL" and chaos["killed"]["pieces_before"] >= 6
    assert (chaos["completed"], chaos["broken"], chaos["same_text_as_reference"]) == (0, 3, 0)
    assert chaos["migrated"] is None  # no --metrics-url
    assert "broken 3" in proc.stdout
