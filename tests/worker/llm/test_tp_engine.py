"""The engine over a shard group (worker/tp/llm_step.py) equals the engine over the unsharded step
graph, with real gloo groups of real processes (worker/tp/local.py) on 127.0.0.1, and a bad
token id or a rank's exception fails one step's requests, never the group."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from quantize import llm_graph, llm_shard
from quantize.models import DecoderConfig, LlamaDecoder
from tests.worker.llm.test_step_memory import anon_mb
from worker.llm import model as step_model
from worker.llm.cache import CacheShape, KVCache
from worker.llm.engine import EngineConfig
from worker.llm.model import StepModel
from worker.runtime import RuntimeOptions
from worker.tp.llm_step import RankSteps, TPStepModel, pack, unpack
from worker.tp.local import run_engine, run_llm_group
from worker.tp.parallel import destroy_tp_group, init_tp_group
from worker.tp.runtime import find_shard_sets

MAX_POSITIONS = 512
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "kv_cache_tokens": 1024, "prefill_chunk": 8}
CPU = ["CPUExecutionProvider"]
LONG = "Once upon a time, in a land far away, there lived a king who had three daughters"


def tp_decoder() -> LlamaDecoder:
    """6 heads / 2 KV heads of 16 dims (GroupQueryAttention on CPU needs head_size % 16 ==
    0): TP 2 gives each rank 3 heads and 1 KV head. Weights of std 0.2 so that greedy
    decoding varies from token to token instead of repeating one."""
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=49152, hidden=96, layers=2, heads=6, kv_heads=2, intermediate=128
    )
    model = LlamaDecoder(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def group_repo(
    smollm2_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Path]:
    """(repository with TP 1 and 2 shard sets, the unsharded step graph, tokenizer.json)."""
    root = tmp_path_factory.mktemp("tp-llm")
    model = tp_decoder()
    llm_shard.write_model(model, smollm2_tokenizer, "tiny", root / "repo", [1, 2], MAX_POSITIONS)
    graph = llm_graph.save(llm_graph.build(model, MAX_POSITIONS), root / "step.onnx")
    return root / "repo", graph, root / "repo" / "tiny" / "tokenizer.json"


def tp1(graph: Path, tokenizer: Tokenizer, requests: list[list[dict]]) -> dict:
    model = StepModel.load(graph, RuntimeOptions(intra_op_threads=1), CPU)
    return asyncio.run(run_engine(model, tokenizer, EngineConfig(**ENGINE), requests))


def tp2(repo: Path, tokenizer: Path, requests: list[list[dict]], tmp: Path, *extra: str) -> dict:
    return run_llm_group(
        repo,
        "tiny",
        2,
        requests,
        tokenizer,
        tmp,
        "--intra-op-threads",
        "1",
        *extra,
        engine_config=ENGINE,
        timeout=180,
    )


def test_pack_round_trip() -> None:
    shape = CacheShape(2, 1, 16, 4, 256)
    ids = np.array([[5], [0], [7]], np.int64)
    ops = [(0, 2, -1, 0, 0), (1, 0, 3, 0, 48)]  # discard slot 2; copy 48 rows of slot 0 to 3
    step = unpack(pack(shape, 1, 4, ids, np.array([9, 1, 3]), ops))
    assert (step.slots, step.max_len, step.lo, step.hi) == (4, 256, 1, 4)
    assert step.ops == ops and step.lengths.tolist() == [9, 1, 3]
    assert step.ids.tolist() == ids.tolist()


class _Recorder:
    def __init__(self) -> None:
        self.calls = 0

    def call(self, index: int, op: int, arg: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        self.calls += 1
        raise AssertionError("nothing reaches the group")


def test_bad_token_id_is_refused_before_the_broadcast(group_repo) -> None:  # type: ignore[no-untyped-def]
    repo, _, _ = group_repo
    (shards,) = [s for s in find_shard_sets(repo, 2) if s.model == "tiny"]
    rank = RankSteps(shards, 0, RuntimeOptions(intra_op_threads=1), CPU)
    leader = _Recorder()
    model = TPStepModel(rank, leader, 0)
    f = model.facts
    assert (f.heads, f.kv_heads, f.head_dim) == (3, 1, 16)  # one rank's share
    cache = KVCache(CacheShape(f.layers, f.kv_heads, f.head_dim, 2, 256))
    try:
        for bad in (49152, -1):
            with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
                model.run(cache, np.array([[3], [bad]]), np.array([1, 1]), 0, 2)
    finally:
        cache.close()
    assert leader.calls == 0


def test_single_rank_group_equals_the_step_model(group_repo) -> None:  # type: ignore[no-untyped-def]
    """TP 1 through the same RankSteps path (world 1: collectives are the identity)."""
    repo, graph, _ = group_repo
    (shards,) = [s for s in find_shard_sets(repo, 1) if s.model == "tiny"]
    rank = RankSteps(shards, 0, RuntimeOptions(intra_op_threads=1), CPU)
    ref = StepModel.load(graph, RuntimeOptions(intra_op_threads=1), CPU)
    f = ref.facts
    caches = [KVCache(CacheShape(f.layers, f.kv_heads, f.head_dim, 2, 256)) for _ in "ab"]
    group = init_tp_group(0, 1)
    try:
        rank.attach(caches[1])
        steps = [
            (np.array([[5, 6, 7], [8, 9, 10]]), np.array([3, 3])),
            (np.array([[11], [12]]), np.array([4, 4])),
        ]
        for ids, lengths in steps:
            want = ref.run(caches[0], ids, lengths, 0, 2)
            got = rank.step(group, pack(caches[1].shape, 0, 2, ids, lengths, []))
            assert got is not None
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        np.testing.assert_allclose(caches[1].data, caches[0].data, atol=1e-6, rtol=0)
    finally:
        destroy_tp_group()
        for c in caches:
            c.close()


@pytest.mark.slow  # starts a tp2 group of rank processes
def test_tp2_generates_the_tokens_of_tp1(group_repo, smollm2_tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    repo, graph, tokenizer = group_repo
    requests = [
        [
            {"text": "The capital of France is", "max_tokens": 16},
            {"text": LONG, "max_tokens": 8, "after": 4},  # joins mid-generation, chunked prefill
            {"prompt": [1, 2, 3], "max_tokens": 6},
            {"text": "Sampled", "max_tokens": 8, "params": {"temperature": 0.8, "seed": 7}},
        ],
        [{"text": "A second wave reuses freed slots", "max_tokens": 5}],
    ]
    want = tp1(graph, smollm2_tokenizer, requests)
    got = tp2(repo, tokenizer, requests, tmp_path)
    assert got["backend"] == "gloo"
    assert want["joined_running"] >= 1 and got["joined_running"] >= 1
    for wave_got, wave_want in zip(got["results"], want["results"], strict=True):
        for g, w in zip(wave_got, wave_want, strict=True):
            assert g["error"] is None
            assert g["tokens"] == w["tokens"] and g["text"] == w["text"]
    assert len(set(want["results"][0][0]["tokens"])) > 4  # the model does not just repeat
    # (batch compositions may differ: when the joining request arrives depends on timing)


@pytest.mark.slow  # rank processes, twice
@pytest.mark.parametrize("rank", [0, 1])
def test_a_bad_id_or_a_failing_rank_fails_one_step_not_the_group(  # type: ignore[no-untyped-def]
    group_repo, smollm2_tokenizer, tmp_path: Path, rank: int
) -> None:
    repo, graph, tokenizer = group_repo
    first = [
        {"text": "The capital of France is", "max_tokens": 4},
        {"prompt": [5, 49152 + 7, 3], "max_tokens": 4},  # refused before it reaches the group
    ]
    failing = [{"text": "This one meets the failure", "max_tokens": 6}]
    after = [{"text": "The group still serves", "max_tokens": 6}]
    want = tp1(graph, smollm2_tokenizer, [first, failing, after])
    # the first wave: one prefill run + 3 decode runs; the rank fails the next wave's 2nd run
    waves = [first, failing, after]
    got = tp2(repo, tokenizer, waves, tmp_path, "--fail-rank", str(rank), "--fail-step", "6")
    (ok, bad), (failed,), (later,) = got["results"]
    assert ok["tokens"] == want["results"][0][0]["tokens"] and ok["error"] is None
    assert "token id 49159 is outside the vocabulary" in bad["error"]
    assert failed["finish_reason"] == "error"
    assert f"TP rank(s) [{rank}] failed this step" in failed["error"]
    assert failed["tokens"] == want["results"][1][0]["tokens"][:1]  # its prefill's token
    assert later["error"] is None
    assert later["tokens"] == want["results"][2][0]["tokens"]


def test_a_rank_allocates_its_cache_and_frees_the_slots_the_leader_freed(group_repo) -> None:  # type: ignore[no-untyped-def]
    repo, _, _ = group_repo
    (shards,) = [s for s in find_shard_sets(repo, 2) if s.model == "tiny"]
    rank = RankSteps(shards, 1, RuntimeOptions(intra_op_threads=1), CPU)
    shape = CacheShape(2, 1, 16, 2, 256)  # what the leader's engine allocated
    group = init_tp_group(0, 1)  # one process: collectives are the identity
    try:
        rank.step(group, pack(shape, 0, 2, np.array([[5, 6], [7, 8]]), np.array([2, 2]), []))
        assert rank.cache is not None and rank.cache.shape == shape
        data = rank.cache.data  # [kv, layers, slots, kv_heads, max_len, head_dim]
        assert np.abs(data[:, :, 0, :, :2]).sum() > 0 and np.abs(data[:, :, 1, :, :2]).sum() > 0
        rank.step(group, pack(shape, 1, 2, np.array([[9]]), np.array([3]), [(0, 0, -1, 0, 0)]))
        assert not data[:, :, 0].any()  # slot 0's pages went back to the OS
        assert np.abs(data[:, :, 1, :, :3]).sum() > 0
        # the leader's prefix cache copied slot 1's first 2 rows to slot 0: so does the rank
        rank.step(group, pack(shape, 1, 2, np.array([[4]]), np.array([4]), [(1, 1, 0, 0, 2)]))
        assert np.array_equal(data[:, :, 0, :, :2], data[:, :, 1, :, :2])
        assert not data[:, :, 0, :, 2:].any()
    finally:
        destroy_tp_group()
        rank.close()


def _kept_after_chunk(repo: Path, shrink_tokens: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """MB a rank keeps after one 500-token prefill run, beyond the KV rows it wrote."""
    monkeypatch.setattr(step_model, "SHRINK_TOKENS", shrink_tokens)
    (shards,) = [s for s in find_shard_sets(repo, 1) if s.model == "tiny"]
    rank = RankSteps(shards, 0, RuntimeOptions(intra_op_threads=1), CPU)
    f = rank.facts
    cache = KVCache(CacheShape(f.layers, f.kv_heads, f.head_dim, 2, MAX_POSITIONS))
    group = init_tp_group(0, 1)  # one process: collectives are the identity
    rng = np.random.default_rng(0)
    try:
        rank.attach(cache)
        rank.step(group, pack(cache.shape, 0, 1, rng.integers(0, 49152, (1, 8)), np.array([8]), []))
        before = anon_mb()
        chunk = rng.integers(0, 49152, (1, 500))
        rank.step(group, pack(cache.shape, 1, 2, chunk, np.array([500]), []))
        return anon_mb() - before - 500 * cache.shape.bytes_per_token / 2**20
    finally:
        destroy_tp_group()
        rank.close()
        cache.close()


def test_a_ranks_long_chunk_hands_its_step_buffers_back(group_repo, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A rank's segments shrink their arena after a long chunk, as one process's step does
    (worker/llm/model.run_options; tests/worker/llm/test_step_memory.py)."""
    repo, _, _ = group_repo
    kept = _kept_after_chunk(repo, step_model.SHRINK_TOKENS, monkeypatch)
    arena = _kept_after_chunk(repo, 501, monkeypatch)  # the same run, not shrunk
    assert arena > 8, f"the arena kept only {arena:.1f} MB: this test no longer tells"
    assert kept < arena / 2, f"kept {kept:.1f} MB after the chunk (the arena: {arena:.1f})"
