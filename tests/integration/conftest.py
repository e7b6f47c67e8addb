"""The real mesh every integration test starts from: a private redis-server, torn down
(processes killed) after the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devmesh.testing import Mesh


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    m = Mesh(tmp_path / "logs")
    m.start_redis()
    yield m
    m.stop()
