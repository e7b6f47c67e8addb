"""A tiny random decoder as the engine's step graph, with SmolLM2's real tokenizer, so the
engine's scheduling runs on real onnxruntime sessions in milliseconds per step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from devmesh.processes import ROOT
from quantize import llm, llm_graph, weights
from quantize.models import DecoderConfig, LlamaDecoder
from worker.llm.engine import Engine, EngineConfig
from worker.llm.model import StepModel
from worker.llm.speculative import DraftConfig, NgramConfig, SpeculativeConfig
from worker.runtime import RuntimeOptions

CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served SmolLM2 int8 model folder (its graph built once into build/quantize)."""
    folder, _ = llm.build(
        tmp_path_factory.mktemp("smollm2"), llm.DEFAULT_RECIPE, ROOT / "build" / "quantize"
    )
    return folder


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


@pytest.fixture(scope="session")
def speculative_graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Step graphs for speculative decoding: a tiny decoder whose layers are scaled up so that
    it writes varied tokens (tiny_decoder repeats its last prompt token), as `target` (last
    position) and `verify` (all positions, for a draft), and as `draft` its first layer
    alone, a student before any training that agrees with it on some tokens (13% here)."""
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=49152, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128
    )
    target = LlamaDecoder(config).eval()
    with torch.no_grad():
        for name, weight in target.named_parameters():
            if name.startswith("layers.") and weight.dim() == 2:
                weight.mul_(3.0)
    draft = LlamaDecoder(dataclasses.replace(config, layers=1)).eval()
    draft.load_state_dict(
        {k: v for k, v in target.state_dict().items() if not k.startswith("layers.1.")}
    )
    folder = tmp_path_factory.mktemp("tiny-llm-speculative")
    return {
        "target": llm_graph.save(llm_graph.build(target, 512), folder / "target.onnx"),
        "verify": llm_graph.save(
            llm_graph.build(target, 512, all_positions=True), folder / "verify.onnx"
        ),
        "draft": llm_graph.save(llm_graph.build(draft, 512), folder / "draft.onnx"),
    }


@pytest.fixture
def make_engine(tiny_step_graph: Path, smollm2_tokenizer: Tokenizer):  # type: ignore[no-untyped-def]
    """`async with make_engine(**config) as engine:` an engine over the tiny graph (or
    `graph`), started on the running loop and closed on exit; with `draft` (a step graph)
    and `num_speculative_tokens`, a speculative decoding engine; with `ngram`, one proposing
    by n-gram lookup."""

    @contextlib.asynccontextmanager
    async def make(
        graph: Path | None = None,
        draft: Path | None = None,
        num_speculative_tokens: int = 4,
        ngram: NgramConfig | None = None,
        **overrides: int,
    ) -> AsyncIterator[Engine]:
        options = RuntimeOptions(intra_op_threads=1)
        model = StepModel.load(graph or tiny_step_graph, options, CPU)
        drafting: SpeculativeConfig | None = ngram
        if draft is not None:
            drafting = DraftConfig(StepModel.load(draft, options, CPU), num_speculative_tokens)
        defaults = {"max_model_len": 256, "max_num_seqs": 4, "kv_cache_tokens": 1024}
        config = EngineConfig(**{**defaults, **overrides})
        engine = Engine(model, smollm2_tokenizer, config, draft=drafting)
        engine.start()
        try:
            yield engine
        finally:
            await engine.close()

    return make
