"""A pytest plugin (`-p public_suites_plugin`) loaded into a public suite's own venv by
benchmarks/public_suites.py: it deselects the excluded tests and, for Triton's suite, points
`tests.utils.OpenAIServer` at the mesh instead of a Triton process. It imports nothing of
meshserve (the suites' venvs do not have it); settings come in the environment.

PUBLIC_SUITES_EXCLUDE: a JSON list of fnmatch patterns over test ids.
PUBLIC_SUITES_MARKER: only the tests with this marker run (the others are excluded).
PUBLIC_SUITES_DESELECTED: a file to write the excluded tests' ids to (JSON).
PUBLIC_SUITES_TRITON_URL: http://host:port of the mesh (Triton's suite only).
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
from urllib.parse import urlsplit


class _Anything:
    def __getattr__(self, name: str) -> _Anything:
        return self

    def __call__(self, *args: object, **kwargs: object) -> _Anything:
        return self


_ANY = _Anything()


def _triton_shims(url: str) -> None:
    """tests/utils.py imports Triton's server and frontend modules at import: empty modules
    stand in for them (the in-process tests that use them are excluded), then the server
    class the conftest imports is ours, a client of the mesh."""
    for name in (
        "tritonserver",
        "engine",
        "engine.triton_engine",
        "frontend",
        "frontend.fastapi_frontend",
    ):
        module = types.ModuleType(name)
        # utils.py reads names of these at import (defaults such as
        # tritonserver.ModelControlMode.NONE); only the excluded in-process tests use them.
        module.__getattr__ = lambda attr: _ANY  # type: ignore[method-assign]
        sys.modules.setdefault(name, module)
    sys.path.insert(0, os.getcwd())
    import openai

    import tests.utils as utils

    where = urlsplit(url)

    class MeshServer:
        API_KEY = "EMPTY"

        def __init__(self, cli_args: list[str], *, env_dict: dict | None = None) -> None:
            self.host, self.port = where.hostname, where.port

        def __enter__(self) -> MeshServer:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        @property
        def url_root(self) -> str:
            return f"http://{self.host}:{self.port}"

        def url_for(self, *parts: str) -> str:
            return self.url_root + "/" + "/".join(parts)

        def get_client(self) -> openai.OpenAI:
            return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.API_KEY)

        def get_async_client(self) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.API_KEY)

    utils.OpenAIServer = MeshServer


if os.environ.get("PUBLIC_SUITES_TRITON_URL"):
    _triton_shims(os.environ["PUBLIC_SUITES_TRITON_URL"])


def matches(test_id: str, pattern: str) -> bool:
    """`pattern` with `*` for any run of characters; everything else literal (test ids hold
    brackets, which fnmatch would read as sets)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), test_id) is not None


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    patterns = json.loads(os.environ.get("PUBLIC_SUITES_EXCLUDE", "[]"))
    keep, drop = [], []
    marker = os.environ.get("PUBLIC_SUITES_MARKER")  # the tests without it are dropped
    for item in items:
        unmarked = marker is not None and item.get_closest_marker(marker) is None
        excluded = unmarked or any(matches(item.nodeid, p) for p in patterns)
        (drop if excluded else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    record = os.environ.get("PUBLIC_SUITES_DESELECTED")
    if record:
        with open(record, "w") as f:
            json.dump([item.nodeid for item in drop], f)
