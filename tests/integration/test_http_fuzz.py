"""Fuzzing the router's HTTP front door on a real mesh: malformed JSON, wrong types, bodies
built from the v2 and OpenAI schemas' parts, huge bodies and slow-loris clients. Whatever a
client sends, the answer is a 4xx with a JSON error (never a traceback), the router keeps
serving, and its log holds no internal error. Bounded: a few hundred examples."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.net import free_port
from devmesh import toy_models
from devmesh.testing import Mesh

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_BODY = 256 << 10
PATHS = [
    "/v2/models/mlp/infer",
    "/v2/models/add_sub/infer",
    "/v2/models/identity_bytes/infer",
    "/v2/models/nope/infer",
    "/v2/models/mlp/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
]


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, int, Counter]]:
    root = tmp_path_factory.mktemp("http-fuzz")
    repository = root / "models"
    toy_models.write(repository / "mlp", toy_models.mlp(), toy_models.MLP_CONFIG)
    toy_models.write(repository / "add_sub", toy_models.add_sub())
    toy_models.write(repository / "identity_bytes", toy_models.identity("BYTES"))
    mesh = Mesh(root / "logs")
    mesh.start_redis()
    try:
        mesh.add_worker(repository)
        mesh.wait_registered(1)
        port = free_port()
        mesh.start_router(
            "--http-port", str(port), "--http-max-body-bytes", str(MAX_BODY),
            "--http-header-timeout-seconds", "1", "--http-body-timeout-seconds", "1",
        )  # fmt: skip
        codes: Counter = Counter()
        yield mesh, port, codes
    finally:
        mesh.stop(kill=True)


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        c.request("POST", path, body, {"content-type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def check(status: int, body: bytes, codes: Counter) -> None:
    codes[status] += 1
    assert status < 500 or status == 503, (status, body[:300])
    assert b"Traceback" not in body
    if status >= 400:
        error = json.loads(body)["error"]
        assert error, body[:300]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
KEYS = ["inputs", "outputs", "name", "shape", "datatype", "data", "parameters", "id",
        "binary_data_size", "model", "messages", "prompt", "input", "max_tokens", "stream",
        "temperature", "n", "role", "content", "text_input", "tools", "tool_choice",
        "function", "response_format", "type", "json_schema", "schema", "logprobs",
        "instructions"]  # fmt: skip
documents = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS), inner, max_size=6),
    max_leaves=30,
)


@FUZZ
@given(path=st.sampled_from(PATHS), doc=documents)
def test_schema_shaped_bodies_get_4xx_or_an_answer(front, path: str, doc: object) -> None:  # type: ignore[no-untyped-def]
    _, port, codes = front
    status, body = post(port, path, json.dumps(doc).encode())
    check(status, body, codes)


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    raw=st.binary(max_size=300),
    header=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=6),
)
def test_malformed_bytes_and_binary_headers(front, path: str, raw: bytes, header: str) -> None:  # type: ignore[no-untyped-def]
    _, port, codes = front
    headers = {"inference-header-content-length": header} if header else {}
    try:
        status, body = post(port, path, raw, headers)
    except (http.client.HTTPException, OSError):  # a header http.client itself refuses
        return
    check(status, body, codes)


def test_huge_bodies_and_slow_clients(front) -> None:  # type: ignore[no-untyped-def]
    mesh, port, codes = front
    status, body = post(port, "/v2/models/mlp/infer", b"[" * (MAX_BODY + 1))
    assert status == 413, body
    # Deep nesting within the limit: refused, not a RecursionError.
    status, body = post(port, "/v2/models/mlp/infer", b"[" * 100_000 + b"]" * 100_000)
    assert status in (400, 413), body
    # Slow-loris: headers never finished, a body never finished. Both answered 408 and closed.
    start = b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\n"
    for head in (start, start + b"content-length: 100\r\n\r\n{"):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(head)
        t0 = time.monotonic()
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - t0 < 5
        s.close()
    # Many idle connections at once do not stop the router from answering.
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    status, _ = post(port, "/v2/models/mlp/infer", _mlp_body())
    assert status == 200
    for s in idle:
        s.close()


def _mlp_body() -> bytes:
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
    ).encode()


def test_the_router_still_serves_and_logged_no_internal_error(front) -> None:  # type: ignore[no-untyped-def]
    mesh, port, codes = front
    status, body = post(port, "/v2/models/mlp/infer", _mlp_body())
    assert status == 200 and len(json.loads(body)["outputs"][0]["data"]) == 4
    assert codes[400] > 50, codes  # the fuzz reached the checks
    logs = "".join(p.read_text(errors="replace") for p in Path(mesh.log_dir).glob("router*"))
    assert "http_internal_error" not in logs and "Traceback" not in logs
