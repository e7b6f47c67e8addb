"""benchmarks/llm_run.py: llama.cpp's in-process timings are counted as loadtest's LLM mode
counts a served stream (every token by re-tokenizing). Fast: no model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from benchmarks import llm_run
from common.corpus import python_reference


@pytest.fixture(scope="module")
def context() -> llm_run.Context:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator([python_reference()[:50_000]], trainer)
    args = argparse.Namespace(
        lengths=[8, 24],
        requests_per_stream=2,
        max_tokens=3,
        level_deadline_s=30.0,
        concurrency=[2],
        repeats=2,
        decode_tokens=3,
        ignore_eos=False,
    )
    return llm_run.Context(args, Path("unused.gguf"), tokenizer, [], "", None)


def test_in_process_timings_are_counted_as_a_served_stream(context: llm_run.Context) -> None:
    prompt = context.prompts([20])[0]
    text = "def f(x): return x"
    tokens = len(context.tokenizer.encode(text).ids)
    run = llm_run._inprocess_run(context, prompt, {"text": text, "first_s": 0.1, "last_s": 0.5})
    assert run["completion_tokens"] == tokens and run["ttft_ms"] == pytest.approx(100)
    assert run["itl_ms"] == pytest.approx(400 / (tokens - 1), rel=1e-3)
    assert run["prompt_tokens"] == len(context.tokenizer.encode(prompt.text).ids)
    empty = llm_run._inprocess_run(context, prompt, {"text": "", "first_s": None, "last_s": None})
    assert empty["completion_tokens"] == 0 and empty["ttft_ms"] is None
