"""The llama-server anchor runs the worker on a copy of the repository with config.pbtxt
parameters added (`--model-parameter`): the copy says them, the original is untouched, and
the weights are linked, not copied. Fast, no servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import llm
from worker import config as worker_config
from worker.repository import _spinning


def test_a_parameter_reaches_a_linked_copy_and_leaves_the_repository_alone(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    (repo / "smollm2" / "1").mkdir(parents=True)
    original = 'name: "smollm2"\nbackend: "onnxruntime"\n'
    (repo / "smollm2" / "config.pbtxt").write_text(original)
    (repo / "smollm2" / "1" / "model.onnx").write_bytes(b"graph")

    params = llm.parameters(["meshserve.intra_op_spinning=true"])
    copy = llm.with_parameters(repo, params, tmp_path / "logs")

    assert copy != repo and _spinning(worker_config.read(copy / "smollm2"))
    assert not _spinning(worker_config.read(repo / "smollm2"))
    assert (repo / "smollm2" / "config.pbtxt").read_text() == original
    weights = copy / "smollm2" / "1" / "model.onnx"
    assert weights.stat().st_ino == (repo / "smollm2" / "1" / "model.onnx").stat().st_ino
    assert llm.with_parameters(repo, {}, tmp_path / "logs") == repo


def test_a_parameter_without_a_value_is_refused() -> None:
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        llm.parameters(["meshserve.intra_op_spinning"])
