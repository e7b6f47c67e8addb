"""The KV cache's device side, as far as a machine without a GPU can check it: the byte
layout the CUDA cache binds and copies by (worker/llm/device.py) against the host cache's
numpy layout, where each cache lives, and the engine's step budget per device. The CUDA
path itself ran on an H200 (benchmarks/llm_gpu.py, results/llm_gpu_*.json)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from worker.llm.cache import CacheShape, KVCache
from worker.llm.device import Layout
from worker.llm.engine import EngineConfig
from worker.llm.model import StepModel, cache_device
from worker.llm.serving import default_step_tokens
from worker.runtime import CPU, CUDA, RuntimeOptions

SHAPE = CacheShape(layers=3, kv_heads=2, head_dim=8, slots=4, max_len=16, dtype="float16")


@pytest.fixture
def cache():
    c = KVCache(SHAPE)
    c.data[:] = np.arange(c.data.size, dtype=np.float16).reshape(c.data.shape) % 2048
    yield c
    c.close()


def test_offsets_are_the_host_layout(cache: KVCache) -> None:
    layout = cache.layout
    assert layout == Layout(cache.data.shape, cache.data.itemsize)
    base = cache.data.ctypes.data
    for kv in range(2):
        for layer in range(SHAPE.layers):
            for slot in range(SHAPE.slots):
                view = cache.data[kv, layer, slot:]
                assert layout.offset(kv, layer, slot) == view.ctypes.data - base


def test_row_copies_do_what_the_host_copy_does(cache: KVCache) -> None:
    """cudaMemcpy2D's copies, replayed on the host's bytes, equal KVCache.copy_rows."""
    replayed = bytearray(cache.data.tobytes())
    for dst, src, pitch, width, height in cache.layout.row_copies(1, 3, 5, 11):
        for line in range(height):
            a, b = dst + line * pitch, src + line * pitch
            replayed[a : a + width] = replayed[b : b + width]
    cache.copy_rows(1, 3, 5, 11)
    assert bytes(replayed) == cache.data.tobytes()
    assert not np.array_equal(cache.data[:, :, 3, :, :5], cache.data[:, :, 1, :, :5])


def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device 'tpu'.*expected one of"):
        KVCache(SHAPE, device="tpu")


def test_the_cache_lives_where_the_attention_runs() -> None:
    path = Path("model.onnx")
    assert cache_device(CPU, "float16", path) == "cpu"
    assert cache_device(CUDA, "float16", path) == "cuda"
    with capture_logs() as logs:
        assert cache_device(CUDA, "float32", path) == "cpu"
    assert logs[0]["event"] == "llm_cache_on_host"
    assert "--kv-dtype float16" in logs[0]["hint"]


def test_a_gpu_step_takes_a_whole_chunk() -> None:
    assert default_step_tokens("cuda", 512) == 512
    assert default_step_tokens("cpu", 512) == EngineConfig.max_step_tokens


@pytest.mark.parametrize("graph", ["target", "verify"])
def test_a_decode_step_bound_for_a_cuda_graph_gives_the_ordinary_tokens(  # type: ignore[no-untyped-def]
    speculative_graphs, graph: str
) -> None:
    """The binding a CUDA graph replays (every input and output at a fixed address, the
    cache's whole length as total_sequence_length), run here on the host: the same top-k,
    row by row, step after step, as the ordinary binding gives; `verify` has num_logits."""
    model = StepModel.load(speculative_graphs[graph], RuntimeOptions(intra_op_threads=1), [CPU])
    assert not model.graphs  # only a CUDA session replays graphs
    f = model.facts
    runs = {}
    for graphs in (False, True):
        model.graphs = graphs
        cache = KVCache(f.cache_shape(3, 64))
        rng = np.random.default_rng(0)
        for slot in range(3):
            n = 10 + slot
            model.run(cache, rng.integers(100, 40000, (1, n)), np.array([n]), slot, slot + 1)
        lengths, ids = np.array([10, 11, 12]), rng.integers(100, 40000, (3, 1))
        steps = []
        for _ in range(6):
            lengths = lengths + 1
            values, best = model.run_top(cache, ids, lengths, 0, 3)
            steps.append((values, best))
            ids = best[:, :1]
        runs[graphs] = steps
        assert (("graph", id(model), 0, 3) in cache.bindings) == graphs
        cache.close()
    assert model._graphs_made == 1
    for (v0, b0), (v1, b1) in zip(runs[False], runs[True], strict=True):
        np.testing.assert_array_equal(b0, b1)
        np.testing.assert_allclose(v0, v1, rtol=1e-5)
    assert len({int(b[0, 0]) for _, b in runs[True]}) > 1  # the rows moved on
