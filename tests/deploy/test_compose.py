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


def _services() -> dict:
    import yaml

    return yaml.safe_load((compose_check.DEPLOY / "compose.yaml").read_text())


def test_compose_redis_keeps_an_append_only_file_on_a_volume() -> None:
    """A restarted Redis container comes back with what it held (docs/state.md)."""
    spec = _services()
    redis = spec["services"]["redis"]
    command = redis["command"]
    flags = dict(zip(command[1::2], command[2::2], strict=False))
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] in ("everysec", "always")
    data = flags["--dir"]
    volumes = [v.split(":") for v in redis["volumes"]]
    assert [name for name, path in volumes if path == data] == ["redis-data"]
    assert "redis-data" in spec["volumes"]  # a named volume, not the container's layer


def test_compose_runs_the_ledger_that_refills_redis() -> None:
    """The ledger holds the tenants' database on a volume and can write Redis's tenant keys."""
    spec = _services()
    ledger = spec["services"]["ledger"]
    assert "ledger-data" in spec["volumes"]
    (mount,) = [v.split(":")[1] for v in ledger["volumes"] if v.startswith("ledger-data:")]
    db = ledger["command"][ledger["command"].index("--db") + 1]
    assert db.startswith(f"sqlite:///{mount}/")
    assert ledger["environment"]["MESHSERVE_ADMIN_DB"] == db  # the admin CLI's, beside it
    assert "redis_ledger_password" in ledger["secrets"]
