"""Install size per role: one throwaway venv per pyproject extra, measured on disk.

    python -m benchmarks.install_sizes [--roles router worker ...] [--keep]

No Docker engine is needed (or used): each role's extra is pip-installed, not editable, into
a fresh venv under build/install-sizes/<role>, and the venv's site-packages is measured less
that of an empty venv (pip itself). This is the Python payload an image of that role adds on
top of its base image (python:3.11-slim), not an image size. It also records whether torch,
onnxruntime or numpy came in. Writes benchmarks/results/install_sizes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine, write_result

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "install-sizes"
ROLES = ["router", "worker", "worker-gpu", "worker,tp", "ledger", "loadtest", "build"]
WATCHED = ["torch", "onnxruntime", "numpy", "matplotlib", "psycopg", "nvidia"]


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            f = Path(dirpath) / name
            if not f.is_symlink():
                total += f.stat().st_size
    return total


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def new_venv(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path / "bin" / "python"


def measure(role: str, baseline: int, keep: bool) -> dict:
    venv = WORK / role.replace(",", "+")
    python = new_venv(venv)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", f"{ROOT}[{role}]"],
        check=True,
        timeout=1800,
    )
    site = site_packages(venv)
    by_package = sorted(
        ((p.name, tree_bytes(p)) for p in site.iterdir() if p.is_dir()),
        key=lambda item: -item[1],
    )
    total = tree_bytes(site) - baseline
    result = {
        "extra": role,
        "site_packages_mb": round(total / 1e6, 1),
        "has": {name: any(n.startswith(name) for n, _ in by_package) for name in WATCHED},
        "largest_mb": {n: round(b / 1e6, 1) for n, b in by_package[:6]},
    }
    if not keep:
        shutil.rmtree(venv, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.install_sizes", description=__doc__)
    parser.add_argument("--roles", nargs="+", default=ROLES)
    parser.add_argument("--keep", action="store_true", help="keep the venvs")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    empty = new_venv(WORK / "empty").parent.parent
    baseline = tree_bytes(site_packages(empty))
    results = []
    for role in args.roles:
        r = measure(role, baseline, args.keep)
        print(json.dumps(r), flush=True)
        results.append(r)
    shutil.rmtree(empty, ignore_errors=True)
    path = write_result(
        "install_sizes",
        {
            "machine": machine(),
            "what": "site-packages of a fresh venv per extra, less an empty venv's; "
            "pip install (not editable) from this checkout, wheels from this machine's "
            "indexes (torch is its +cpu build here); no Docker engine, so not image sizes",
            "results": results,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
