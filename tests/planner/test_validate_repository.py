"""`planner validate` serves its LLM configurations from the graph a worker serves (weights
beside the graph, quantize/llm.served_graph), not the single-file graph of the quantize
cache. Builds the SmolLM2 int8 artifact into build/quantize if it is not there yet."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from planner.validate import configs
from quantize import llm
from worker.llm.cache import KVCache
from worker.llm.model import StepModel
from worker.runtime import RuntimeOptions

CACHE = Path(__file__).resolve().parents[2] / "build" / "quantize"


def test_an_llm_configuration_is_served_from_the_graph_and_its_weights(tmp_path: Path) -> None:
    c = configs.Config(configs.LLM_MODEL, llm.DEFAULT_RECIPE, 1, 4)
    root = configs.repository(tmp_path, c, CACHE)
    version = root / c.model / "1"
    assert sorted(p.name for p in version.iterdir()) == ["model.onnx", "model.onnx.data"]
    graph = version / "model.onnx"
    assert graph.stat().st_size < 2**20  # the nodes only: the weights are in the .data file
    model = StepModel.load(graph, RuntimeOptions(intra_op_threads=1, allow_spinning=False), [])
    cache = KVCache(model.facts.cache_shape(slots=1, max_len=64))
    try:
        values, ids = model.run_top(cache, np.array([[1, 2, 3]]), np.array([3]), 0, 1)
        assert np.isfinite(values).all() and 0 <= ids[0, 0] < model.facts.vocab_size
    finally:
        cache.close()
    assert "meshserve.max_num_seqs" in (root / c.model / "config.pbtxt").read_text()
