"""quantize/gguf_random.py: a random GGUF of a given shape whose vocabulary is padded to the
shape's rows, as benchmarks/llm_checkpoint.py writes Qwen2.5-0.5B's shape over SmolLM2's
tokenizer: the checkpoint reader serves it, the pads' rows are zero and greedy never
emits one."""

from __future__ import annotations

from pathlib import Path

import tiny_gguf
import torch

from quantize import checkpoints, gguf_random
from quantize.models import greedy

ROWS = 512  # the tiny vocabulary's 320 tokens, padded


def padded_file(tmp_path: Path) -> Path:
    shape = gguf_random.Shape(64, 2, 4, 2, 96, 512, vocab=ROWS, rope_theta=1e6, eps=1e-6)
    layout = gguf_random.Layout("qwen2", tied=True, bias=True)
    vocab = tiny_gguf.vocabulary("qwen2")
    return gguf_random.write(tmp_path / "padded.gguf", shape, layout, vocab, "Q8_0")


def test_a_padded_vocabulary_keeps_the_shape_and_zeroes_the_pads(tmp_path: Path) -> None:
    ck = checkpoints.load(padded_file(tmp_path))
    assert ck.architecture == "qwen2" and ck.config.tie_embeddings and ck.config.qkv_bias
    assert ck.config.vocab_size == ROWS
    assert ck.tokenizer.get_vocab_size() == ROWS
    assert ck.tokenizer.token_to_id("[PAD320]") == 320
    embed = ck.state["embed.weight"].numpy()
    assert not embed[320:].any() and embed[:320].any(axis=1).all()
    ids = ck.tokenizer.encode("abc def").ids
    assert ids and max(ids) < 320  # text never tokenizes to a pad


def test_greedy_never_emits_a_pad(tmp_path: Path) -> None:
    model = checkpoints.load(padded_file(tmp_path)).model()
    with torch.no_grad():
        tokens = greedy(model, torch.tensor([[5, 40, 41, 300, 7, 99]]), 24)
    assert max(tokens) < 320
