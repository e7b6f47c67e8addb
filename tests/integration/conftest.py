"""The real mesh every integration test starts from: a private redis-server, torn down
(processes killed) after the test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from devmesh.processes import ROOT
from devmesh.testing import Mesh
from quantize import llm


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    m = Mesh(tmp_path / "logs")
    m.start_redis()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def llm_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 as the worker serves it (the default recipe), built once per module from the
    shared quantize cache."""
    root = tmp_path_factory.mktemp("llm-repo")
    llm.build(root, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
    return root


@contextlib.contextmanager
def llm_mesh(root: Path, parameters: Mapping[str, str]) -> Iterator[tuple[Mesh, str]]:
    """SmolLM2 built with these engine `parameters` in root/repo, served by one worker of
    a mesh with API keys (its logs in root/logs): (the mesh, the worker's address); every
    process killed after."""
    llm.build(root / "repo", llm.DEFAULT_RECIPE, ROOT / "build" / "quantize", parameters=parameters)
    mesh = Mesh(root / "logs")
    mesh.auth = True
    mesh.start_redis()
    try:
        worker = mesh.add_worker(root / "repo")
        mesh.wait_registered(1, timeout=120)
        yield mesh, worker
    finally:
        mesh.stop(kill=True)
