"""A tiny random decoder as the engine's step graph, with SmolLM2's real tokenizer, so the
engine's scheduling runs on real onnxruntime sessions in milliseconds per step."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from quantize import llm_graph, weights
from quantize.models import DecoderConfig, LlamaDecoder
from worker.llm.engine import Engine, EngineConfig
from worker.llm.model import StepModel
from worker.runtime import RuntimeOptions


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    from gguf import GGUFReader

    return weights.gguf_tokenizer(GGUFReader(str(weights.smollm2_gguf())))


@pytest.fixture(scope="session")
def tiny_decoder() -> LlamaDecoder:
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=49152, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128
    )
    return LlamaDecoder(config).eval()


@pytest.fixture(scope="session")
def tiny_step_graph(tiny_decoder: LlamaDecoder, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llm") / "model.onnx"
    return llm_graph.save(llm_graph.build(tiny_decoder, 512), path)


@pytest.fixture
def make_engine(tiny_step_graph: Path, smollm2_tokenizer: Tokenizer):  # type: ignore[no-untyped-def]
    """`async with make_engine(**config) as engine:` an engine over the tiny graph, started
    on the running loop and closed on exit."""

    @contextlib.asynccontextmanager
    async def make(**overrides: int) -> AsyncIterator[Engine]:
        model = StepModel.load(
            tiny_step_graph, RuntimeOptions(intra_op_threads=1), ["CPUExecutionProvider"]
        )
        defaults = {"max_model_len": 256, "max_num_seqs": 4, "kv_cache_tokens": 1024}
        engine = Engine(model, smollm2_tokenizer, EngineConfig(**{**defaults, **overrides}))
        engine.start()
        try:
            yield engine
        finally:
            await engine.close()

    return make
