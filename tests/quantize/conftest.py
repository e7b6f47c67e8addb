"""Tiny random stand-ins for the real models, so the pipeline runs in seconds."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from onnx import numpy_helper
from tokenizers import Tokenizer, models, pre_tokenizers

from quantize import evaluate, pipeline, recipes, weights
from quantize.models import BertEncoder, DecoderConfig, EncoderConfig, LlamaDecoder
from quantize.recipes import DECODER_GATE, ENCODER_GATE, Recipe


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer over the evaluation sets' words (id 0 = [PAD], 1 = [UNK])."""
    text = " ".join(
        evaluate.load_set("encoder")["sentences"] + evaluate.load_set("decoder")["prompts"]
    )
    words = sorted(set(re.findall(r"\w+|[^\w\s]", text)))
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


VOCAB = 256


def tiny_minilm() -> weights.Loaded:
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=VOCAB, hidden=32, layers=2, heads=4, intermediate=64)
    return weights.Loaded(BertEncoder(config).eval(), word_tokenizer())


def tiny_smollm2() -> weights.Loaded:
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96
    )
    return weights.Loaded(LlamaDecoder(config).eval(), word_tokenizer())


def _copy(src: Path, dst: Path) -> None:
    shutil.copy(src, dst)


def _harm(src: Path, dst: Path) -> None:
    """Scramble every weight matrix: a recipe the gate must refuse."""
    model = onnx.load(str(src))
    for init in model.graph.initializer:
        array = numpy_helper.to_array(init)
        if array.ndim == 2 and array.dtype.kind == "f":
            init.CopyFrom(numpy_helper.from_array(array[::-1].copy(), init.name))
    onnx.save(model, str(dst))


@pytest.fixture
def tiny_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        pipeline.SOURCES,
        "minilm",
        pipeline.Source(
            "minilm",
            recipes.ENCODER,
            tiny_minilm,
            ("encoder-int8-dynamic",),
            pipeline.SOURCES["minilm"].config,
        ),
    )
    monkeypatch.setitem(
        pipeline.SOURCES,
        "smollm2",
        pipeline.Source(
            "smollm2",
            recipes.DECODER,
            tiny_smollm2,
            ("decoder-int8-weight-only",),
            pipeline.SOURCES["smollm2"].config,
            max_batch_size=4,
        ),
    )
    for kind, gate in (("encoder", ENCODER_GATE), ("decoder", DECODER_GATE)):
        monkeypatch.setitem(
            recipes.RECIPES, f"{kind}-copy", Recipe(f"{kind}-copy", kind, "test", gate, _copy)
        )
        monkeypatch.setitem(
            recipes.RECIPES, f"{kind}-harm", Recipe(f"{kind}-harm", kind, "test", gate, _harm)
        )
