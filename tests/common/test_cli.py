"""Flags derived from the settings classes: every setting has one, declared once."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import cli
from router.__main__ import parse_args as router_args
from router.process.settings import RouterSettings
from worker.__main__ import parse_args as worker_args
from worker.settings import WorkerSettings


@pytest.mark.parametrize("settings", [WorkerSettings, RouterSettings])
def test_every_setting_but_a_secret_is_a_flag(settings: type) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_flags(parser, settings)
    dests = {a.dest for a in parser._actions} - {"help"}
    secrets = {n for n in settings.model_fields if n.endswith("password")}
    assert dests == set(settings.model_fields) - secrets
    assert secrets  # a password is environment or file only


def test_flags_over_environment_over_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_WORKER_PORT", "9001")
    monkeypatch.setenv("MESHSERVE_WORKER_HOST", "10.0.0.1")
    s = worker_args(["--host", "127.0.0.2", "--providers", "cpu", "--require-gpu"])
    assert (s.host, s.port, s.providers, s.require_gpu) == ("127.0.0.2", 9001, "cpu", True)
    assert s.model_repository == Path("models")  # the default
    assert worker_args(["--no-reflection"]).reflection is False


def test_router_negative_flags_and_choices() -> None:
    s = router_args(["--no-auth", "--no-accounting", "--policy", "p2c_depth"])
    assert (s.auth, s.accounting, s.policy) == (False, False, "p2c_depth")
    assert router_args([]).policy == "prefix"  # the default (benchmarks/llm_prefix.py)
    with pytest.raises(SystemExit):
        router_args(["--policy", "fastest"])  # not a choice: argparse's exit 2
    with pytest.raises(SystemExit):
        worker_args(["--redis-password", "x"])  # never a flag
