"""Every default path, resolved in one place.

From a checkout (a source tree with pyproject.toml beside common/), defaults live in its
build/ folder, wherever the command runs from; from an installed package, in
$MESHSERVE_HOME, else ~/.cache/meshserve. MESHSERVE_BUILD_DIR overrides both. Read when
asked, never at import.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_PACKAGE_PARENT = Path(__file__).resolve().parents[1]


def source_root() -> Path | None:
    """The checkout this code runs from, or None for an installed package."""
    root = _PACKAGE_PARENT
    return root if (root / "pyproject.toml").exists() and (root / "protos").is_dir() else None


def build_dir() -> Path:
    if override := os.environ.get("MESHSERVE_BUILD_DIR"):
        return Path(override)
    root = source_root()
    if root is not None:
        return root / "build"
    home = os.environ.get("MESHSERVE_HOME")
    return Path(home) if home else Path.home() / ".cache" / "meshserve"


def build(*parts: str) -> Path:
    """A default location under build_dir(): build("models"), build("quantize", "reports")."""
    return build_dir().joinpath(*parts)


def results(*parts: str) -> Path:
    """Where measured runs write their result files: benchmarks/results of a checkout
    (the benchmarks and `python -m planner validate`), else build_dir()/results."""
    root = source_root()
    base = root / "benchmarks" / "results" if root is not None else build_dir() / "results"
    return base.joinpath(*parts)


def link_or_copy(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src` when both are on one disk (no second copy), else a copy."""
    try:
        dst.hardlink_to(src)
    except OSError:
        shutil.copy(src, dst)
