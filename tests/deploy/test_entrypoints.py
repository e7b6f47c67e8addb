"""Every process the images and compose files start is a real CLI given flags it accepts.

Each `python -m <module> ...` found in a Dockerfile (CMD, ENTRYPOINT, HEALTHCHECK) or in a
compose service (command, healthcheck) is parsed by that module's own argparse, and every
MESHSERVE_* environment variable names a field of that process's settings. Each role's
Dockerfile installs that role's extra and starts that role's process. (The Kubernetes
manifests get the same checks in test_k8s.py.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]
from pydantic_settings import BaseSettings

import client.__main__
import common.health
import devmesh.models
import ledger.__main__
import loadtest.__main__
import loadtest.llm.cli
import quantize.__main__
import router.__main__
import worker.__main__
from devmesh import compose_check
from ledger.settings import LedgerSettings
from router.process.settings import RouterSettings
from router.tenancy.keys import AdminSettings
from worker.settings import WorkerSettings

DEPLOY = compose_check.DEPLOY
CLIS: dict[str, Callable[[list[str]], object]] = {
    "worker": worker.__main__.parse_args,
    "router": router.__main__.parse_args,
    "loadtest": lambda argv: (  # --llm is a mode with a parser of its own
        loadtest.llm.cli.parse_args if "--llm" in argv else loadtest.__main__.parse_args
    )(argv),
    "client": client.__main__.parse_args,
    "common.health": common.health.parse_args,
    "ledger": ledger.__main__.parse_args,
    "quantize": quantize.__main__.parse_args,
    "devmesh.models": devmesh.models.parse_args,
}
SETTINGS: dict[str, type[BaseSettings]] = {
    "MESHSERVE_WORKER_": WorkerSettings,
    "MESHSERVE_ROUTER_": RouterSettings,
    "MESHSERVE_LEDGER_": LedgerSettings,
    "MESHSERVE_ADMIN_": AdminSettings,  # the tenants CLI, run in the ledger's container
}
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile*"))
# Dockerfile.<role>: the extras it installs and the process it starts.
ROLES = {
    "router": ({"router"}, "router"),
    "worker": ({"worker"}, "worker"),
    "worker-gpu": ({"worker-gpu"}, "worker"),
    "worker-tp": ({"worker", "tp"}, "worker"),
    "ledger": ({"ledger"}, "ledger"),
    "loadtest": ({"loadtest"}, "loadtest"),
    "build": ({"build"}, "quantize"),
}
# What else a role's image may start as a compose service (its CMD is the first).
ALSO_STARTS = {"build": {"devmesh.models"}}
SERVES_GRPC = {"router", "worker"}
COMPOSE_FILES = sorted({name for files in compose_check.VARIANTS for name in files})


def check_cli(argv: list[str], where: str) -> str:
    assert argv[:2] == ["python", "-m"], f"{where}: {argv} does not start with python -m"
    module = argv[2]
    assert module in CLIS, f"{where}: python -m {module} is none of {sorted(CLIS)}"
    try:
        CLIS[module](argv[3:])
    except SystemExit as e:
        raise AssertionError(f"{where}: python -m {module} refuses {argv[3:]}") from e
    return module


def dockerfile_commands(path: Path) -> dict[str, list[str]]:
    """The exec-form arrays of CMD, ENTRYPOINT and HEALTHCHECK ... CMD (line continuations
    joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    found = {}
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "HEALTHCHECK":
            found["HEALTHCHECK"] = json.loads(rest.split(" CMD ", 1)[1])
        elif word in ("CMD", "ENTRYPOINT"):
            found[word] = json.loads(rest)
    return found


def installed_extras(path: Path) -> set[str]:
    """The extras of every `pip install -e '.[a,b]'` in a Dockerfile."""
    found = re.findall(r"pip install -e '\.\[([a-z,-]+)\]'", path.read_text())
    return {extra for group in found for extra in group.split(",")}


def test_every_role_has_a_dockerfile() -> None:
    assert {p.name.removeprefix("Dockerfile.") for p in DOCKERFILES} == set(ROLES)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoints_are_real_clis(path: Path) -> None:
    extras, module = ROLES[path.name.removeprefix("Dockerfile.")]
    assert installed_extras(path) == extras
    commands = dockerfile_commands(path)
    argv = commands.get("ENTRYPOINT", []) + commands.get("CMD", [])
    assert check_cli(argv, f"{path.name} CMD") == module
    if module in SERVES_GRPC:
        assert check_cli(commands["HEALTHCHECK"], f"{path.name} HEALTHCHECK") == "common.health"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_commands_are_real_clis(name: str) -> None:
    services = yaml.safe_load((DEPLOY / name).read_text())["services"]
    started = set()
    for service, spec in services.items():
        where = f"{name} service {service}"
        if "command" in spec and spec["command"][0] == "python":
            module = check_cli(spec["command"], where)
            started.add(module)
            dockerfile = spec.get("build", {}).get("dockerfile")
            if dockerfile:
                role = dockerfile.removeprefix("deploy/Dockerfile.")
                assert module == ROLES[role][1] or module in ALSO_STARTS.get(role, ()), where
        test = spec.get("healthcheck", {}).get("test")
        if test and test[1] == "python":
            check_cli(test[1:], f"{where} healthcheck")
        for key in spec.get("environment", {}):
            prefix = next((p for p in SETTINGS if key.startswith(p)), None)
            if prefix:
                field = key.removeprefix(prefix).lower()
                assert field in SETTINGS[prefix].model_fields, f"{where}: {key} sets nothing"
        for dockerfile in [spec.get("build", {}).get("dockerfile")]:
            if dockerfile:
                assert (compose_check.ROOT / dockerfile).exists(), f"{where}: no {dockerfile}"
    if name == "compose.yaml":
        assert started == {"worker", "router", "ledger", "loadtest", "devmesh.models"}
        assert services["loadtest"]["profiles"] == ["loadtest"]
        assert sum(s.startswith("worker-") for s in services) == 3


def test_check_cli_rejects_a_wrong_flag() -> None:
    with pytest.raises(AssertionError, match="refuses"):
        check_cli(["python", "-m", "worker", "--no-such-flag"], "test")
    with pytest.raises(AssertionError, match="none of"):
        check_cli(["python", "-m", "workers"], "test")
