"""Sampling from the step graph's own top-k (the logits never leave onnxruntime) gives the
tokens sampling from the full logits gives, seed for seed; rows that need the whole
vocabulary (penalties, top_p alone, no truncation) still read the logits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from worker.llm.engine import Engine
from worker.llm.sampling import Sampler, SamplingParams, top_ids

SAMPLED = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6),  # EOS banned at first
    SamplingParams(max_tokens=12, temperature=0.9, top_k=5, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.3, top_k=40, top_p=0.8, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.7, top_k=64, seed=2, min_tokens=4),
]
FULL = [
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=65, seed=4, ignore_eos=True),
]


def onnx_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's own TopK (largest, sorted), as the step graph runs it."""
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1, largest=1, sorted=1)],
        "top",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None])],
        [
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, None]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [1, None]),
        ],
        [helper.make_tensor("k", TensorProto.INT64, [1], [k])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values, ids = session.run(None, {"x": logits[None]})
    return values[0], ids[0]


def test_top_ids_are_the_graphs_top_k_ties_included() -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        logits = rng.integers(-6, 6, 3000).astype(np.float32)  # many ties, at the cut too
        k = int(rng.integers(1, 64))
        values, ids = onnx_top_k(logits, k)
        assert np.array_equal(top_ids(logits, k), ids), trial
        assert np.array_equal(logits[ids], values)


def test_each_sampler_gives_the_same_token_from_the_top_k_as_from_the_logits() -> None:
    rng = np.random.default_rng(1)
    for params in SAMPLED:
        full, top = Sampler(params, [1, 2], 3000), Sampler(params, [1, 2], 3000)
        for step in range(30):
            logits = (rng.standard_normal(3000) * 3).round(1).astype(np.float32)  # ties
            banned = [5, 9] if step % 3 == 0 else []
            need = top.top_needed(len(banned))
            assert need is not None and need <= 64 + 2
            values, ids = onnx_top_k(logits, 64 + len(banned))
            assert full.sample(logits.copy(), banned) == top.sample_top(values, ids, banned)
    for params in FULL:
        assert Sampler(params, [1], 3000).top_needed() in (None, 65)


def tokens(make_engine, graph: Path, params: list[SamplingParams], top: bool):  # type: ignore[no-untyped-def]
    async def main() -> tuple[list[list[int]], Engine]:
        async with make_engine(graph=graph) as engine:
            if not top:
                engine.runner.top = None  # every run reads the logits
            seqs = [engine.add([17 + i, 420, 9001, 33, 5], p) for i, p in enumerate(params)]
            for s in seqs:
                async for _ in engine.stream(s):
                    pass
            return [s.tokens for s in seqs], engine

    return asyncio.run(main())


@pytest.mark.parametrize("batch", [False, True])
def test_the_engine_gives_the_same_tokens_both_ways(make_engine, speculative_graphs, batch) -> None:  # type: ignore[no-untyped-def]
    """Alone (one row per run) and batched (a run whose rows all allow the top-k reads it,
    one row needing the logits makes the run read them), the same seeds, the same tokens."""
    graph = speculative_graphs["target"]  # varied tokens, its own top-64
    groups = [SAMPLED + FULL] if batch else [[p] for p in SAMPLED + FULL]
    for params in groups:
        via_top, engine = tokens(make_engine, graph, params, top=True)
        via_logits, plain = tokens(make_engine, graph, params, top=False)
        assert via_top == via_logits
        assert plain.stats.top_runs == 0
        # a sampler that needs the whole row never reads the top-k; in a batch the others'
        # first tokens still come from it (each prompt's chunk is a run of its own)
        assert (engine.stats.top_runs > 0) == (batch or params[0] in SAMPLED)
