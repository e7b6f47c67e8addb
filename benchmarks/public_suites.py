"""Public test suites against a mesh started as `make run` starts it (issue 47's target).

llama.cpp's server tests (tools/server/tests, vendored in the llama-cpp-python sdist on
PyPI) and Triton's OpenAI-frontend tests (python/openai/tests, a checkout given by
--triton) run unmodified except the address and the model names (the router's
--http-model-aliases). The SELECTED files run; tests matching an EXCLUDED pattern are
deselected, each pattern with its reason. Results: benchmarks/results/public_suites.json;
docs/public_suites.md lists the selection.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.public_suites [--triton PATH] [--url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks.public_suites_plugin import matches
from benchmarks.public_suites_selection import ALIASES, LLAMA, TRITON, UNMARKED
from common.net import free_port

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "public-suites"
RESULTS = ROOT / "benchmarks" / "results" / "public_suites.json"
PLUGIN_DIR = Path(__file__).resolve().parent
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp's server tests
TEST_TIMEOUT_S = 60


def download_llama(dest: Path) -> Path:
    """The llama-cpp-python sdist from PyPI, unpacked under dest (once)."""
    root = dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if (root / LLAMA["path"]).is_dir():
        return root
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            str(dest),
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
        ],
        check=True,
    )
    with tarfile.open(dest / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
        tar.extractall(dest, filter="data")
    return root


def venv(path: Path, requirements: list[str]) -> Path:
    """A venv for a suite (its own pins, not ours), made once."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True)
    return python


class MeshRun:
    """A mesh as `make run` starts it (devmesh.launch, auth off) on free ports."""

    def __init__(self, log_dir: Path) -> None:
        self.http, self.grpc = free_port(), free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MESHSERVE_ROUTER_HTTP_MODEL_ALIASES": ",".join(f"{k}={v}" for k, v in ALIASES.items()),
        }
        log_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "devmesh.launch",
                "--workers",
                "1",
                "--router-processes",
                "1",
                "--port",
                str(self.grpc),
                "--http-port",
                str(self.http),
                "--log-dir",
                str(log_dir),
            ],
            cwd=ROOT,
            env=env,
            stdout=(log_dir / "launch.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.http}"

    def wait(self, timeout_s: float = 300) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError("devmesh.launch exited: see its launch.log")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    served = r.read()
                if b'"smollm2"' in served and b'"minilm"' in served:
                    return
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"the mesh did not serve smollm2 within {timeout_s}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_suite(name: str, python: Path, cwd: Path, suite: dict, env: dict, budget_s: float) -> dict:
    """Run a suite's selected files under pytest; counts from its junit XML."""
    junit, deselected = WORK / f"{name}.xml", WORK / f"{name}.deselected.json"
    deselected.unlink(missing_ok=True)
    patterns = list(suite["excluded"])
    cmd = [
        str(python),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "public_suites_plugin",
        f"--junitxml={junit}",
        "--timeout",
        str(TEST_TIMEOUT_S),
        "--tb=line",
        f"--session-timeout={max(60, budget_s - 60)}",
        *suite["selected"],
    ]
    env = {
        **os.environ,
        **env,
        "PYTHONPATH": str(PLUGIN_DIR),
        "PUBLIC_SUITES_EXCLUDE": json.dumps(patterns),
        "PUBLIC_SUITES_DESELECTED": str(deselected),
        **({"PUBLIC_SUITES_MARKER": suite["marker"]} if suite.get("marker") else {}),
    }
    junit.unlink(missing_ok=True)
    start = time.monotonic()
    with contextlib.suppress(subprocess.TimeoutExpired):  # the junit XML so far still counts
        subprocess.run(cmd, cwd=cwd, env=env, timeout=budget_s, check=False)
    dropped = json.loads(deselected.read_text()) if deselected.exists() else []
    reasons = {
        t: next((r for p, r in suite["excluded"].items() if matches(t, p)), UNMARKED)
        for t in dropped
    }
    return {
        "seconds": round(time.monotonic() - start),
        **counts(junit),
        "excluded": len(dropped),
        "excluded_tests": reasons,
    }


def counts(junit: Path) -> dict:
    if not junit.exists():
        return {
            "selected": 0,
            "passed": 0,
            "failed": 0,
            "skipped": 0,
            "failures": ["no junit XML (timed out?)"],
        }
    failures, passed, skipped = [], 0, 0
    for case in ET.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failures.append(test)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return {
        "selected": passed + len(failures) + skipped,
        "passed": passed,
        "failed": len(failures),
        "skipped": skipped,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--llama",
        type=Path,
        help="a llama-cpp-python sdist tree (default: "
        "downloaded from PyPI under build/public-suites)",
    )
    parser.add_argument("--triton", type=Path, help="a checkout of triton-inference-server/server")
    parser.add_argument("--url", help="a running mesh (default: start one on free ports)")
    parser.add_argument("--budget-seconds", type=float, default=1800, help="per suite")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    mesh = None if args.url else MeshRun(WORK / "logs")
    suites: dict[str, dict] = {}
    try:
        if mesh is not None:
            mesh.wait()
        url = args.url or mesh.url  # type: ignore[union-attr]
        port = url.rsplit(":", 1)[1].strip("/")
        llama = args.llama or download_llama(WORK)
        tests = llama / LLAMA["path"]
        python = venv(
            WORK / "venv-llama", ["-r", str(tests / "requirements.txt"), "pytest-timeout==2.4.0"]
        )
        suites["llama.cpp"] = run_suite(
            "llama.cpp",
            python,
            tests,
            LLAMA,
            {"DEBUG_EXTERNAL": "1", "PORT": port},
            args.budget_seconds,
        )
        if args.triton and (args.triton / TRITON["path"]).is_dir():
            tpython = venv(
                WORK / "venv-triton",
                [
                    "pytest==8.1.1",
                    "pytest-asyncio==0.23.8",
                    "pytest-timeout==2.4.0",
                    "openai==1.107.3",
                    "fastapi",
                    "httpx==0.27.2",
                    "requests",
                ],
            )
            suites["triton"] = run_suite(
                "triton",
                tpython,
                args.triton / "python" / "openai",
                TRITON,
                {"PUBLIC_SUITES_TRITON_URL": url, "TEST_BACKEND": "vllm", "TEST_MODEL": "smollm2"},
                args.budget_seconds,
            )
        else:
            print(
                "Triton's suite skipped: give --triton PATH (a checkout of "
                "triton-inference-server/server; not reachable from CI)"
            )
    finally:
        if mesh is not None:
            mesh.stop()
    write(suites, " ".join(["python -m benchmarks.public_suites", *(argv or sys.argv[1:])]))
    return 0 if all(s["selected"] and s["passed"] == s["selected"] for s in suites.values()) else 1


def write(suites: dict[str, dict], command: str) -> None:
    rows: list[list[Any]] = []
    for name, s in suites.items():
        met = "met" if s["selected"] and s["passed"] == s["selected"] else "missed"
        rows.append(
            [
                f"{name}: passed / selected",
                f"{s['passed']} / {s['selected']}",
                "every selected test passes",
                met,
            ]
        )
        rows.append([f"{name}: failed", s["failed"], 0, "met" if s["failed"] == 0 else "missed"])
        rows.append([f"{name}: excluded (model- or server-specific)", s["excluded"], "", ""])
    summary = {
        "title": "Public suites (llama.cpp server tests, Triton OpenAI frontend)",
        "machine": f"{platform.node()}: {os.cpu_count()} cores, shared, no GPU",
        "date": datetime.date.today().isoformat(),
        "command": command,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"suites": suites, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
