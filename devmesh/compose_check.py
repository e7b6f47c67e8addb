"""Validate the compose files without a Docker engine: `docker-compose config -q`.

    python -m devmesh.compose_check        (also `make compose-check`)

docker-compose 1.29.2 (pip) parses, merges and schema-checks the files without talking to
a daemon. It needs PyYAML 5.4.1, whose sdist only builds with Cython < 3 and without build
isolation, so it lives in a venv of its own: build/compose-venv, created here when missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from common import paths

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VENV = paths.build("compose-venv")
INSTALL_STEPS = [
    ["cython==0.29.37", "wheel==0.48.0"],
    ["--no-build-isolation", "pyyaml==5.4.1"],
    ["docker-compose==1.29.2"],
]
# Each variant is the list of files passed with -f, in order (later files override).
VARIANTS = [
    ["compose.yaml"],
    ["compose.yaml", "compose.gpu.yaml"],
    ["compose.yaml", "compose.tp.yaml"],
]


def docker_compose() -> Path:
    return VENV / "bin" / "docker-compose"


def ensure_venv(timeout: float = 600) -> Path:
    """build/compose-venv with docker-compose 1.29.2; recreated if the stamp disagrees."""
    stamp = VENV / ".meshserve-stamp"
    wanted = repr(INSTALL_STEPS)
    if stamp.exists() and stamp.read_text() == wanted and docker_compose().exists():
        return docker_compose()
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=timeout)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    for step in INSTALL_STEPS:
        subprocess.run([*pip, *step], check=True, timeout=timeout)
    stamp.write_text(wanted)
    return docker_compose()


def validate(files: list[str]) -> subprocess.CompletedProcess:
    args = [str(docker_compose())]
    for name in files:
        args += ["-f", str(DEPLOY / name)]
    return subprocess.run(
        [*args, "config", "-q"], cwd=DEPLOY, capture_output=True, text=True, timeout=120
    )


def main() -> int:
    ensure_venv()
    failed = 0
    for files in VARIANTS:
        result = validate(files)
        label = " + ".join(files)
        if result.returncode == 0:
            print(f"ok      {label}")
        else:
            failed += 1
            print(f"INVALID {label}\n{result.stdout}{result.stderr}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
