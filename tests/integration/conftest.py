"""The real mesh every integration test starts from: a private redis-server, torn down
(processes killed) after the test."""

from __future__ import annotations

from collections.abc import Iterator
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
