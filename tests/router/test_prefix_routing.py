"""Cache-aware routing over fake replicas: the prompt read from request bytes, the bounded
index, the one cost (overlap against load), the p2c fallback and restarts."""

from __future__ import annotations

import dataclasses
import random
import struct

from common.mesh_state import DepthSample, ModelEntry, WorkerInfo, now_ms
from protos import grpc_service_pb2 as pb
from router.forwarding.dispatch import Dispatcher
from router.forwarding.policies import PREFIX_WEIGHT, Ask, Candidate, Setup
from router.forwarding.policies.prefix import Prefix
from router.forwarding.prefix_index import PrefixIndex, prompt_of
from router.forwarding.replica import Replica
from tests.router.fakes import FakeChannel

MODEL = "smollm2"
SYSTEM = ("You are a helpful assistant. Answer briefly and cite the manual. " * 12).encode()


def request(text: bytes, raw: bool = True, salt: str = "") -> bytes:
    r = pb.ModelInferRequest(model_name=MODEL, id="1")
    r.inputs.add(name="stream", datatype="BOOL", shape=[1])
    t = r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    if salt:
        r.parameters["cache_salt"].string_param = salt
    if raw:
        r.raw_input_contents.append(b"\x01")
        r.raw_input_contents.append(struct.pack("<I", len(text)) + text)
    else:
        t.contents.bytes_contents.append(text)
    return r.SerializeToString()


def replica(worker: str, kv_used: int = 0, started_ms: int = 1, fresh: bool = True) -> Replica:
    info = WorkerInfo(
        worker, "127.0.0.1:1", {MODEL: ModelEntry(["1"], 64)}, "CPU", started_ms=started_ms
    )
    r = Replica(info, FakeChannel())  # type: ignore[arg-type]
    at = now_ms() if fresh else now_ms() - 60_000
    r.sample = DepthSample(kv_used // 100, at, kv_used, 16384)
    return r


def choose(
    candidates: list[Candidate],
    rng: random.Random,
    need: int = 1,
    preferred: str | None = None,
    blocks: int = 0,
) -> Candidate:
    """One pick of the prefix policy on `rng`."""
    return Prefix(Setup(rng)).choose(candidates, Ask(need, preferred, blocks))


def dispatcher(policy_name: str = "prefix", seed: int = 0) -> Dispatcher:
    return Dispatcher(None, None, policy_name, rng=random.Random(seed))  # type: ignore[arg-type]


def test_the_prompt_is_read_from_raw_or_typed_contents_with_its_salt() -> None:
    assert prompt_of(request(b"hello")) == (b"hello", "")
    assert prompt_of(request(b"hello", raw=False, salt="acme")) == (b"hello", "acme")
    assert prompt_of(b"\xff\xff not a request") is None
    assert prompt_of(pb.ModelInferRequest(model_name="m").SerializeToString()) is None


def test_the_index_is_chained_bounded_and_forgets_a_replica() -> None:
    index = PrefixIndex(max_blocks=20)
    keys = index.keys(MODEL, SYSTEM)
    assert len(keys) == len(SYSTEM) // 64 and index.keys(MODEL, SYSTEM, "acme") != keys
    assert index.keys("other", SYSTEM)[0] != keys[0]
    index.record(keys[:5], "a@1")
    index.record(keys[:2], "b@1")
    assert index.overlaps(keys, ["a@1", "b@1", "c@1"]) == {"a@1": 5, "b@1": 2, "c@1": 0}
    index.record(index.keys(MODEL, b"x" * 64 * 30), "c@1")
    assert len(index) == 20  # the oldest blocks went
    assert index.forget("c@1") > 0 and "c@1" not in index.holders()


def test_the_replica_holding_the_prefix_wins_until_load_outweighs_it() -> None:
    rng = random.Random(1)
    blocks = 50
    holder = Candidate("a", 1, 64, 10_000, overlap=48, decode_blocks=0)
    idle = Candidate("b", 0, 64, 10_000, overlap=0, decode_blocks=0)
    assert choose([holder, idle], rng, blocks=blocks).id == "a"
    # a busy holder: its decode blocks outweigh weight x the 48 cached blocks
    busy = dataclasses.replace(holder, decode_blocks=int(PREFIX_WEIGHT * 48) + 1)
    assert choose([busy, idle], rng, blocks=blocks).id == "b"
    # a deep queue of waiting sequences (they hold no KV yet): far busier, not picked
    queued = dataclasses.replace(holder, load=8)
    assert choose([queued, idle], rng, blocks=blocks).id == "b"
    # a few more requests than the other: the cache still wins
    assert choose([dataclasses.replace(holder, load=3), idle], rng, blocks=blocks).id == "a"
    # full, or no KV room: out, whatever it holds
    full = dataclasses.replace(holder, kv_free=10)
    assert choose([full, idle], rng, need=100, blocks=blocks).id == "b"
    # a session's replica counts as holding the whole prompt
    assert choose([idle, holder], rng, preferred="b", blocks=blocks).id == "b"


def test_an_unknown_load_falls_back_to_p2c() -> None:
    rng = random.Random(2)
    holder = Candidate("a", 3, 64, None, overlap=50, decode_blocks=None)
    idle = Candidate("b", 0, 64, None, overlap=0, decode_blocks=None)
    assert {choose([holder, idle], rng, blocks=50).id for _ in range(20)} == {"b"}


def test_a_conversation_sticks_a_new_prefix_balances_and_none_dominates() -> None:
    """16 conversations on 8 system prompts, 4 turns each: every later turn goes where its
    history is, and the prompts spread (no replica above 65% of the requests)."""
    d = dispatcher()
    a, b = replica("a"), replica("b")
    picks: dict[str, int] = {"a": 0, "b": 0}
    history = {c: b"System %d: " % (c % 8) + SYSTEM for c in range(16)}
    where: dict[int, str] = {}
    for turn in range(4):
        for c in range(16):
            history[c] += b" user turn %d of conversation %d, a question ..." % (turn, c) * 2
            chosen = d.pick([a, b], MODEL, raw=request(history[c]))
            picks[chosen.id] += 1
            if turn:
                assert chosen.id == where[c], (turn, c)
            where[c] = chosen.id
            # what the replica now runs, as its next KV sample says
            r = a if chosen.id == "a" else b
            r.sample = DepthSample(1, now_ms(), r.sample.kv_used + 300, 16384)  # type: ignore[union-attr]
    assert max(picks.values()) <= 0.65 * sum(picks.values()), picks


def test_a_restarted_replica_loses_its_entries_and_redis_loss_is_p2c() -> None:
    d = dispatcher()
    a, b = replica("a"), replica("b")
    raw = request(SYSTEM)
    first = d.pick([a, b], MODEL, raw=raw)
    assert d.pick([a, b], MODEL, raw=raw).id == first.id  # it holds the prompt now
    index = d.picker.index
    assert any(h.startswith(f"{first.id}@") for h in index.holders())
    again = replica(first.id, started_ms=99)  # the worker restarted: a new start time
    other = b if first.id == "a" else a
    d.pick([again, other], MODEL, raw=request(b"unrelated " * 20))
    assert f"{first.id}@1" not in index.holders()
    # samples stale (Redis lost): still answers, by p2c over the router's own calls
    stale = [replica("a", fresh=False), replica("b", fresh=False)]
    assert d.pick(stale, MODEL, raw=raw).id in {"a", "b"}


def test_a_replica_that_left_or_restarted_is_forgotten_at_the_next_pick() -> None:
    """The pool a pick gets leaves out ejected and tried replicas; the registry's replicas
    (`live`) say which left: only those lose their entries."""
    picker = dispatcher().picker
    a, b = replica("a"), replica("b")
    live = {"a": a, "b": b}
    for i in range(6):  # distinct prompts: both replicas end up holding some
        picker.pick([a, b], MODEL, raw=request(b"Prompt %d " % i + SYSTEM), live=live)
    held = picker.index.held()
    assert set(held) == {"a@1", "b@1"}
    # b ejected (not in the pool) but still registered: it keeps its entries
    picker.pick([a], MODEL, raw=request(b"x" * 200), live=live)
    assert picker.index.held()["b@1"] == held["b@1"]
    # b left the registry: gone
    picker.pick([a], MODEL, raw=request(b"y" * 200), live={"a": a})
    assert "b@1" not in picker.index.held() and len(picker.index) > 0
    # a came back as a new process (same id, new start time): its old entries go
    again = replica("a", started_ms=7)
    picker.pick([again], MODEL, raw=request(b"z" * 200), live={"a": again})
    assert set(picker.index.held()) == {"a@7"}
    assert picker.index.held()["a@7"] == len(picker.index.keys(MODEL, b"z" * 200))


def test_a_model_without_kv_samples_is_not_read_for_a_prompt() -> None:
    """Policy prefix over replicas that publish no KV occupancy (not an LLM): p2c, and the
    request's bytes are not parsed for a prompt (nothing is recorded)."""
    picker = dispatcher().picker
    a, b = replica("a"), replica("b")
    for r in (a, b):
        r.sample = DepthSample(0, now_ms())  # depth only: kv_total 0
    for _ in range(4):
        assert picker.pick([a, b], MODEL, raw=request(SYSTEM)).id in {"a", "b"}
    assert len(picker.index) == 0
