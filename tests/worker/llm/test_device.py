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
from worker.llm.model import cache_device
from worker.llm.serving import default_step_tokens
from worker.runtime import CPU, CUDA

SHAPE = CacheShape(layers=3, kv_heads=2, head_dim=8, slots=4, max_len=16, dtype="float16")


@pytest.fixture
def cache():
    c = KVCache(SHAPE, SHAPE.slots * SHAPE.max_len)
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
        KVCache(SHAPE, 8, device="tpu")


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
