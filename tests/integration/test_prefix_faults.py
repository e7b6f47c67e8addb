"""Cache-aware routing under faults, with real processes: redis-server, two SmolLM2 workers,
the router (`--policy prefix`) and the ledger.

- A worker restarted under the same id comes back with an empty cache: the router's index
  drops what it believed the old process held, the first repeat of a prompt it held is a
  miss (cached_tokens 0), and the new process is picked again.
- Redis killed mid-run: the router routes by p2c over its own calls in flight (the load
  samples go stale), every call succeeds, and once Redis is back the ledger has them all.
- Under both, the ledger bills exactly the prompt, cached and completion tokens the
  clients were sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from common.net import free_port
from devmesh.testing import Mesh, model_usage, settle, worker_successes
from ledger.store import Store
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
MODEL = "smollm2"
SYSTEM = (
    "You are the support assistant of a shipping company. Answer in one short sentence, "
    "quote the tracking rules when they apply, and never promise a delivery date. "
)


@dataclass
class Got:
    """What one client received: the usage of its responses and its text."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0
    text: str = ""
    final: bool = False
    error: str = ""
    responses: int = 0


def llm_request(prompt: str, max_tokens: int, salt: str = "") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=MODEL, id="r1")
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    for name, dtype, value in (
        ("text_input", "BYTES", prompt.encode()),
        ("stream", "BOOL", None),
        ("sampling_parameters", "BYTES", sampling.encode()),
        ("exclude_input_in_output", "BOOL", None),
    ):
        r.inputs.add(name=name, datatype=dtype, shape=[1])
        if value is None:
            r.raw_input_contents.append(b"\x01")
        else:
            r.raw_input_contents.append(len(value).to_bytes(4, "little") + value)
    if salt:
        r.parameters["cache_salt"].string_param = salt
    return r


def _int(response: pb.ModelInferResponse, name: str) -> int:
    p = response.parameters.get(name)
    return p.int64_param if p is not None else 0


async def ask(
    address: str,
    prompt: str,
    max_tokens: int = 4,
    salt: str = "",
    got: Got | None = None,
    cancel: asyncio.Event | None = None,
) -> Got:
    """One streamed request; the client cancels its stream when `cancel` is set. `got`
    fills as the pieces come."""
    got = got if got is not None else Got()
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=180)
        await call.write(llm_request(prompt, max_tokens, salt))
        reader = asyncio.ensure_future(_read(call, got))
        waits = [reader] + ([asyncio.ensure_future(cancel.wait())] if cancel else [])
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if reader not in done:
            call.cancel()
        for task in pending:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await reader
    return got


async def _read(call: grpc.aio.StreamStreamCall, got: Got) -> None:
    try:
        async for r in call:
            got.responses += 1
            if r.error_message:
                got.error = r.error_message
                return
            out = r.infer_response
            got.prompt = max(got.prompt, _int(out, "prompt_tokens"))
            got.cached = max(got.cached, _int(out, "cached_tokens"))
            got.completion = max(got.completion, _int(out, "completion_tokens"))
            if out.raw_output_contents:
                got.text += out.raw_output_contents[0][4:].decode(errors="replace")
            final = out.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                got.final = True
                return
    except grpc.aio.AioRpcError as e:
        got.error = e.code().name


def billed(store: Store) -> tuple[int, ...]:
    """(prompt, cached, completion, successes, errors) of the LLM in the ledger."""
    return model_usage(
        store, MODEL, "prompt_tokens", "cached_tokens", "completion_tokens", "success", "errors"
    )


def received(gots: list[Got]) -> tuple[int, int, int, int, int]:
    ok = [g for g in gots if g.final and not g.error]
    return (
        sum(g.prompt for g in gots),
        sum(g.cached for g in gots),
        sum(g.completion for g in gots),
        len(ok),
        len(gots) - len(ok),
    )


def scrape(port: int) -> dict[str, float]:
    """The router's samples, `name{labels}` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line and not line.startswith("#")
    }


def held(port: int, worker: str) -> float:
    return scrape(port).get(f'meshserve_router_prefix_index_blocks{{worker="{worker}"}}', 0.0)


def worker_id(address: str) -> str:
    host, port = address.rsplit(":", 1)
    return f"worker-{host}-{port}"


@dataclass
class Routed:
    mesh: Mesh
    workers: list[str]
    metrics_port: int
    store: Store
    gots: list[Got] = field(default_factory=list)

    def ask(self, prompt: str, max_tokens: int = 4) -> tuple[Got, str]:
        """One call through the router; what it got and the worker that served it (calls
        made one at a time: the worker whose success count moved)."""
        before = [worker_successes(w, MODEL) for w in self.workers]
        got = asyncio.run(ask(self.mesh.router_address, prompt, max_tokens))
        self.gots.append(got)
        after = [worker_successes(w, MODEL) for w in self.workers]
        moved = [w for w, b, a in zip(self.workers, before, after, strict=True) if a > b]
        assert got.final and not got.error and len(moved) == 1, (got, moved)
        return got, moved[0]


@pytest.fixture
def routed(llm_repository: Path, tmp_path: Path) -> Iterator[Routed]:
    mesh = Mesh(tmp_path / "logs")
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        mesh.start_redis()
        workers = [mesh.add_worker(llm_repository) for _ in range(2)]
        mesh.wait_registered(2)
        port = free_port()
        mesh.start_router("--policy", "prefix", "--metrics-port", str(port))
        mesh.start_ledger(store.url, "--interval-seconds", "0.1")
        yield Routed(mesh, workers, port, store)
    finally:
        mesh.stop(kill=True)
        store.close()


def prompt(i: int) -> str:
    return f"Customer {i} asks: " + SYSTEM * 3 + f"Where is parcel {i}?"


def test_a_restarted_worker_is_forgotten_and_served_again(
    routed: Routed, llm_repository: Path
) -> None:
    m, port = routed.mesh, routed.metrics_port
    # Distinct prompts until each replica holds at least two (bounded); each repeated once:
    # the repeat goes where the prompt is, and hits the cache there.
    where: dict[int, str] = {}
    for i in range(12):
        first, w = routed.ask(prompt(i))
        again, w2 = routed.ask(prompt(i))
        assert first.cached == 0 and w2 == w and again.cached > 0, (first, again, w, w2)
        where[i] = w
        if all(list(where.values()).count(x) >= 2 for x in routed.workers):
            break
    victim = routed.workers[0]
    mine = [i for i, w in where.items() if w == victim]
    assert len(mine) >= 2, where
    before = held(port, worker_id(victim))
    assert before >= 2 * (len(prompt(0)) // 64)  # two prompts' blocks at least

    # Restart it under the same id (same port): it drains and leaves, then joins empty.
    process = m.workers.pop(victim)
    process.stop()
    assert m.add_worker(llm_repository, port=int(victim.rsplit(":", 1)[1])) == victim
    m.wait_registered(2)

    # The first repeat of a prompt the old process held: a miss wherever it goes, and the
    # index holds nothing of the old process after that pick (at most this prompt's blocks).
    repeat, w = routed.ask(prompt(mine[0]))
    assert repeat.cached == 0, repeat
    after = held(port, worker_id(victim))
    assert after < before / len(mine) + 1, (before, after)
    # The new process is picked again: new prompts spread over both replicas (bounded).
    served = {w}
    for i in range(100, 116):
        served.add(routed.ask(prompt(i))[1])
        if served == set(routed.workers):
            break
    assert served == set(routed.workers)

    expected = received(routed.gots)
    assert expected[1] > 0  # the cache did serve tokens in this run
    assert settle(lambda: billed(routed.store), expected) == expected


def test_redis_lost_mid_run_routes_by_p2c_and_bills_every_call(routed: Routed) -> None:
    m, port = routed.mesh, routed.metrics_port
    shared = SYSTEM * 4

    async def load(stop_at: int) -> list[Got]:
        """4 clients, each asking questions on the shared prefix one after another, until
        `stop_at` calls were made in all (bounded in count)."""
        made = 0
        out: list[Got] = []

        async def client(c: int) -> None:
            nonlocal made
            while made < stop_at:
                made += 1
                n = made
                out.append(await ask(m.router_address, shared + f"Question {c}.{n}?"))

        await asyncio.gather(*(client(c) for c in range(4)))
        return out

    before_fallback = scrape(port).get("meshserve_router_prefix_fallback_total", 0.0)
    routed.gots += asyncio.run(load(8))  # Redis up: samples fresh, the cost decides
    assert m.redis_server is not None

    async def outage() -> list[Got]:
        task = asyncio.ensure_future(load(16))
        await asyncio.sleep(0)  # the clients' first calls are on their way: kill Redis
        m.redis_server.kill()  # type: ignore[union-attr]
        return await task

    during = asyncio.run(outage())

    def fallbacks() -> float:
        return scrape(port).get("meshserve_router_prefix_fallback_total", 0.0)

    for _ in range(20):  # more calls until the samples are stale (1 s) and p2c picks (bounded)
        if fallbacks() > before_fallback:
            break
        during += asyncio.run(load(4))
    routed.gots += during
    assert all(g.final and not g.error for g in during), [g.error for g in during if g.error]
    assert fallbacks() > before_fallback  # routed by p2c while the load was unknown
    assert sum(g.cached for g in during) > 0  # the shared prefix still hit a cache

    m.start_redis()  # back on its port, from its append-only file
    routed.gots += asyncio.run(load(4))
    expected = received(routed.gots)
    assert expected[3] == len(routed.gots) and expected[4] == 0  # every call succeeded
    assert settle(lambda: billed(routed.store), expected, timeout=60) == expected
    assert m.redis_server.alive and not any(
        p.popen is not None and p.popen.poll() is not None for p in m.workers.values()
    )


def test_a_prefill_cancelled_midway_is_never_served(llm_repository: Path, tmp_path: Path) -> None:
    """Straight at one worker, prompts prefilled 64 tokens a step: a stream cancelled
    mid-prefill, then the same prompt again; and a stream cancelled mid-prefill while a
    second one waits on the blocks it claimed. Each answer equals a cold run's (the same
    prompt under another cache_salt: no block shared), and cached_tokens counts whole blocks
    only, never more than the prompt less its last token."""
    repo = tmp_path / "repo"
    (repo / MODEL).mkdir(parents=True)
    for item in (llm_repository / MODEL).iterdir():
        if item.name != "config.pbtxt":
            (repo / MODEL / item.name).symlink_to(item)
    (repo / MODEL / "config.pbtxt").write_text(
        (llm_repository / MODEL / "config.pbtxt").read_text()
        + 'parameters { key: "meshserve.prefill_chunk" value { string_value: "64" } }\n'
    )
    mesh = Mesh(tmp_path / "logs")
    try:
        mesh.start_redis()
        address = mesh.add_worker(repo)
        mesh.wait_registered(1)
        redis = mesh.redis_client()
        depth_key = f"meshserve:depth:{worker_id(address)}"

        def sample() -> tuple[int, int, int]:
            """The worker's last (sequences, at unix ms, KV tokens held)."""
            raw = redis.get(depth_key)
            depth, at, *kv = (int(x) for x in str(raw).split(":")) if raw else (0, 0, 0)
            return depth, at, kv[0] if kv else 0

        async def cancelled_midway(text: str, waiter: bool) -> tuple[Got, Got | None]:
            """A (and, with `waiter`, B on the same prompt) in the engine; A cancelled once
            the worker has reported them running for a few samples (100 ms apart while
            busy), before A got any response: mid-prefill."""
            cancel = asyncio.Event()
            a = Got()
            task_a = asyncio.ensure_future(ask(address, text, 8, got=a, cancel=cancel))
            task_b = asyncio.ensure_future(ask(address, text, 8)) if waiter else None
            want, deadline = (2 if waiter else 1), time.monotonic() + 60
            admitted = 0
            while time.monotonic() < deadline:
                depth, at, kv = sample()
                if depth >= want and kv > 0:
                    admitted = admitted or at
                    if at >= admitted + 300:
                        break
                await asyncio.sleep(0.01)
            assert admitted and a.responses == 0, (admitted, a)
            cancel.set()
            await task_a
            return a, (await task_b if task_b else None)

        def whole_blocks(g: Got) -> bool:
            return g.cached % 16 == 0 and g.cached < g.prompt

        # Alone: the next request on that prompt is served as a cold one.
        text = "Tracking rules, section 7: " + SYSTEM * 40  # ~1,250 tokens: ~20 steps
        cold = asyncio.run(ask(address, text, 8, salt="cold"))
        assert cold.final and cold.cached == 0 and cold.prompt > 1024, cold
        a, _ = asyncio.run(cancelled_midway(text, waiter=False))
        assert a.responses == 0 and not a.final, a  # cancelled mid-prefill: no token yet
        again = asyncio.run(ask(address, text, 8))
        assert again.final and again.text == cold.text and whole_blocks(again), (again, cold)

        # A second sequence waiting on the cancelled one's claimed blocks.
        text = "Tracking rules, section 8: " + SYSTEM * 40
        cold = asyncio.run(ask(address, text, 8, salt="cold"))
        a, b = asyncio.run(cancelled_midway(text, waiter=True))
        assert a.responses == 0 and not a.final, a
        assert b is not None and b.final and b.text == cold.text and whole_blocks(b), (b, cold)
    finally:
        mesh.stop(kill=True)
