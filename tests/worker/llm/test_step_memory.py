"""The step graph's memory on the real SmolLM2 int8 graph: a long prefill chunk's step
buffers (its attention scores alone are heads x new x max_len floats) go back to the OS when
its run ends, instead of staying in onnxruntime's arena for the process's life."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import numpy as np
import pytest

from worker.llm import model as step
from worker.llm.cache import KVCache
from worker.llm.model import StepModel
from worker.runtime import RuntimeOptions

CHUNK = 400  # tokens: 9 heads x 400 x 2,048 positions of scores = 29 MB


def anon_mb() -> float:
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("RssAnon")) / 1024


def growth_after_chunk(path: Path, shrink_tokens: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """MB the process keeps after one CHUNK-token prefill run, beyond the KV rows it wrote."""
    monkeypatch.setattr(step, "SHRINK_TOKENS", shrink_tokens)
    model = StepModel.load(path, RuntimeOptions(intra_op_threads=2, allow_spinning=False), [])
    cache = KVCache(model.facts.cache_shape(slots=2, max_len=2048))
    rng = np.random.default_rng(0)
    model.run_top(cache, rng.integers(0, 49152, (1, 8)), np.array([8]), 0, 1)  # warm: a short run
    before = anon_mb()
    model.run_top(cache, rng.integers(0, 49152, (1, CHUNK)), np.array([CHUNK]), 1, 2)
    written = CHUNK * cache.shape.bytes_per_token / 2**20
    return anon_mb() - before - written


def test_a_long_chunks_step_buffers_go_back_to_the_os(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = smollm2 / "1" / "model.onnx"
    kept = growth_after_chunk(graph, step.SHRINK_TOKENS, monkeypatch)
    arena = growth_after_chunk(graph, CHUNK + 1, monkeypatch)  # the same run, not shrunk
    assert arena > 25, f"the arena kept only {arena:.1f} MB: this test no longer tells"
    assert kept < arena / 2, f"kept {kept:.1f} MB after the chunk (the arena: {arena:.1f})"
