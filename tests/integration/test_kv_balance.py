"""KV-aware balancing with real processes: two SmolLM2 replicas with a small KV budget, one
of them filled by a long generation started directly on it; the router (p2c) sends new
requests to the replica with room, exports each replica's KV occupancy, and keeps a
session's requests on one replica."""

from __future__ import annotations

import json
import queue
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from common import mesh_state
from common.net import free_port
from devmesh.processes import ROOT
from devmesh.testing import Mesh, worker_successes
from quantize import llm

pytestmark = pytest.mark.slow
MODEL = "smollm2"
KV_TOKENS = 512
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: K and V x layers x kv heads x dim, fp32


@pytest.fixture(scope="module")
def small_kv_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kv-repo")
    llm.build(root, llm.DEFAULT_RECIPE, ROOT / "build" / "quantize")
    config = root / MODEL / "config.pbtxt"
    text = config.read_text()
    config.unlink()  # a fresh file: the built one may be linked to the build cache
    config.write_text(
        text + 'parameters { key: "meshserve.kv_cache_bytes" value { string_value: '
        f'"{KV_TOKENS * KV_BYTES_PER_TOKEN}" }} }}\n'
    )
    return root


@pytest.fixture(scope="module")
def mesh(
    small_kv_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, str, str, int]]:
    m = Mesh(tmp_path_factory.mktemp("kv-logs"))
    m.start_redis()
    try:
        a, b = m.add_worker(small_kv_repository), m.add_worker(small_kv_repository)
        m.wait_registered(2)
        metrics_port = free_port()
        m.start_router("--policy", "p2c", "--metrics-port", str(metrics_port))
        yield m, a, b, metrics_port
    finally:
        m.stop(kill=True)


def inputs(text: str, sampling: dict) -> list[triton.InferInput]:
    x = triton.InferInput("text_input", [1], "BYTES")
    x.set_data_from_numpy(np.array([text.encode()], dtype=object))
    p = triton.InferInput("sampling_parameters", [1], "BYTES")
    p.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
    return [x, p]


def worker_id(address: str) -> str:
    host, port = address.rsplit(":", 1)
    return f"worker-{host}-{port}"


def kv_used(m: Mesh, address: str) -> int:
    raw = m.redis_client().get(f"meshserve:depth:{worker_id(address)}")
    return int(str(raw).split(":")[2])


def scrape(port: int, name: str, worker: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f'{name}{{worker="{worker}"}}'):
                return float(line.rsplit(" ", 1)[1])
    return None


SHORT = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


def test_new_requests_go_to_the_replica_with_kv_room(mesh) -> None:  # type: ignore[no-untyped-def]
    m, a, b, metrics_port = mesh
    assert m.router_address
    # Fill A: one sequence reserving nearly its whole budget, started on A directly.
    pinned = triton.InferenceServerClient(a)
    got: queue.Queue = queue.Queue()
    pinned.start_stream(callback=lambda result, error: got.put((result, error)))
    long = {"max_tokens": KV_TOKENS - 20, "ignore_eos": True, "temperature": 0}
    pinned.async_stream_infer(MODEL, inputs("Tell me a long story.", long))
    try:
        deadline = time.monotonic() + 30
        while kv_used(m, a) == 0:
            assert time.monotonic() < deadline, "the pinned generation did not start"
            time.sleep(0.05)
        time.sleep(0.3)  # a few router polls
        assert kv_used(m, a) > KV_TOKENS - 30  # A's cache is nearly full, its queue is 1
        # What KEDA reads (worker/scaling.py): A's occupancy in percent (B holds nothing),
        # and the one sequence running.
        r = m.redis_client()
        assert r.llen(mesh_state.scale_kv_key(MODEL)) >= 100 * (KV_TOKENS - 30) // KV_TOKENS
        assert r.llen(mesh_state.scale_queue_key(MODEL)) == 1
        used = scrape(metrics_port, "meshserve_router_replica_kv_used_tokens", worker_id(a))
        assert used is not None and used > KV_TOKENS - 30
        total = scrape(metrics_port, "meshserve_router_replica_kv_total_tokens", worker_id(a))
        assert total == KV_TOKENS
        before = worker_successes(a, MODEL), worker_successes(b, MODEL)

        def call(i: int) -> float:
            client = triton.InferenceServerClient(m.router_address)
            t0 = time.monotonic()
            client.infer(MODEL, inputs(f"Question {i}: what is the sea?", SHORT))
            client.close()
            return time.monotonic() - t0

        with ThreadPoolExecutor(4) as pool:
            latencies = list(pool.map(call, range(8)))
        after = worker_successes(a, MODEL), worker_successes(b, MODEL)
        assert after[0] - before[0] == 0  # none waited behind A's long generation
        assert after[1] - before[1] == 8
        assert kv_used(m, a) > 0  # the long generation was still running throughout
        assert max(latencies) < 20
    finally:
        pinned.stop_stream(cancel_requests=True)
        pinned.close()
    deadline = time.monotonic() + 20
    while kv_used(m, a) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_session_stays_on_one_replica(mesh) -> None:  # type: ignore[no-untyped-def]
    m, a, b, _ = mesh
    client = triton.InferenceServerClient(m.router_address)
    for session in ("chat-1", "chat-2"):
        before = worker_successes(a, MODEL), worker_successes(b, MODEL)
        for i in range(4):
            client.infer(MODEL, inputs(f"Turn {i}.", SHORT), parameters={"session_id": session})
        after = worker_successes(a, MODEL), worker_successes(b, MODEL)
        assert sorted((after[0] - before[0], after[1] - before[1])) == [0, 4]
    client.close()
