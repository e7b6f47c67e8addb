"""TP 2 and 3 with real gloo process groups equal the unsharded model.

MiniLM: all 6 layers of the real weights, TP 2 and 3, against the torch model (fp32, 1e-4).
SmolLM2: the real weights cut to their first 4 of 30 layers (every layer has the same
shape, so 4 exercise every cut), TP 3 (9 heads, 3 KV heads: 3 and 1 per rank): the LLM
engine over the group generates, for prompts that run together and one that joins
mid-generation, the greedy tokens of the same engine over the unsharded step graph.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from quantize import llm_graph, llm_shard, shard, sharding, weights
from worker.llm.engine import EngineConfig
from worker.llm.model import StepModel
from worker.runtime import RuntimeOptions
from worker.tp.local import run_engine, run_group, run_llm_group

pytestmark = pytest.mark.slow

SENTENCES = ["tensor parallel serving", "a much longer sentence that needs more tokens", "hi"]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, dict]:
    try:
        loaded = weights.load_minilm()
    except weights.MissingWeights as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("minilm-tp")
    for tp in (2, 3):
        shard.write_shards(loaded.model, "minilm", root / "minilm", tp)
    loaded.tokenizer.enable_padding()
    enc = loaded.tokenizer.encode_batch(SENTENCES)
    feeds = {
        "input_ids": np.array([e.ids for e in enc], np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
    }
    return root, loaded.model, feeds


@pytest.mark.parametrize("tp", [2, 3])
def test_minilm_tp_equals_unsharded(minilm, tp: int, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, model, feeds = minilm
    with torch.no_grad():
        expected = model(
            torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])
        )
    out = run_group(root, "minilm", tp, feeds, tmp_path)
    assert str(out["backend"]) == "gloo"
    assert out["sentence_embedding"].shape == (3, 384)
    np.testing.assert_allclose(out["sentence_embedding"], expected.numpy(), atol=1e-4, rtol=0)


def test_smollm2_tp3_engine_generates_the_unsharded_tokens(tmp_path: Path) -> None:
    try:
        loaded = weights.load_smollm2()
    except weights.MissingWeights as e:
        pytest.skip(str(e))
    model = sharding.truncate(loaded.model, 4)
    llm_shard.write_model(model, loaded.tokenizer, "smollm2", tmp_path / "repo", [3], 1024)
    step = llm_graph.save(llm_graph.build(model, 1024), tmp_path / "step.onnx")
    config = {"max_model_len": 256, "max_num_seqs": 4, "kv_cache_tokens": 1024}
    requests = [
        [
            {"text": "The capital of France is", "max_tokens": 10},
            {"text": "def fibonacci(n):", "max_tokens": 8},
            {"text": "Tensor parallelism splits", "max_tokens": 6, "after": 3},
        ]
    ]
    unsharded = StepModel.load(step, RuntimeOptions(), ["CPUExecutionProvider"])
    want = asyncio.run(run_engine(unsharded, loaded.tokenizer, EngineConfig(**config), requests))
    tokenizer = tmp_path / "repo" / "smollm2" / "tokenizer.json"
    got = run_llm_group(
        tmp_path / "repo", "smollm2", 3, requests, tokenizer, tmp_path, engine_config=config
    )
    assert got["backend"] == "gloo" and got["joined_running"] >= 1
    for g, w in zip(got["results"][0], want["results"][0], strict=True):
        assert g["error"] is None
        assert g["tokens"] == w["tokens"]
