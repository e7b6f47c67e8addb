"""The compose files pass `docker-compose config -q` (docker-compose 1.29.2, no engine)."""

from __future__ import annotations

import subprocess

import pytest

from devmesh import compose_check


@pytest.fixture(scope="module")
def docker_compose() -> None:
    try:
        compose_check.ensure_venv(timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        pytest.skip(f"could not build {compose_check.VENV} (docker-compose 1.29.2 from PyPI): {e}")


@pytest.mark.parametrize("files", compose_check.VARIANTS, ids=" + ".join)
def test_compose_file_is_valid(docker_compose: None, files: list[str]) -> None:
    result = compose_check.validate(files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_validation_catches_a_bad_file(docker_compose: None, tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = compose_check.DEPLOY / "compose.yaml"
    text = bad.read_text().replace("    profiles: [", "    profile: [", 1)
    broken = tmp_path / "compose.yaml"
    broken.write_text(text)
    result = subprocess.run(
        [str(compose_check.docker_compose()), "-f", str(broken), "config", "-q"],
        cwd=compose_check.DEPLOY,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "profile" in result.stderr
