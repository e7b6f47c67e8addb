"""benchmarks/llm_run.py drives its servers with loadtest's LLM mode: against an HTTP server
on 127.0.0.1 that streams as llama-server does (tests/loadtest/test_llm_openai.py), one
concurrency level and the single-stream runs come out in the result shape benchmarks/llm.py
renders, every token counted by re-tokenizing (not the server's usage); and llama.cpp's
in-process timings are counted the same way. Fast: no model."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from benchmarks import llm_run
from common.corpus import python_reference
from tests.loadtest.test_llm_openai import serve


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


def test_a_level_and_the_single_runs_through_loadtest(context: llm_run.Context) -> None:
    async def main() -> tuple[dict, dict]:
        seen: list[dict] = []
        server, port = await serve(seen)
        async with server:
            target = llm_run.Target(f"http://127.0.0.1:{port}", "openai", "m", {"temperature": 0})
            level = await llm_run.concurrency_level(context, target, 2)
            measured = await llm_run.serve_and_measure(context, target, None, "fake")
        assert all(body["temperature"] == 0 and body["stream"] for body in seen)
        return level, measured

    level, measured = asyncio.run(main())
    tokens = len(context.tokenizer.encode("a b c").ids)  # the server says 3; we re-count
    assert level["streams"] == 2 and level["requests"] == 4 and level["errors"] == 0
    assert level["completion_tokens"] == 4 * tokens and level["token_source"] == {"tokenizer": 4}
    assert level["first_error"] is None and level["output_tokens_per_s"] > 0
    assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"]
    assert 5 < level["itl_p50_ms"] < 1000  # the fake server paces its pieces 10 ms apart
    counted = sorted(level["prompt_tokens"])  # re-encoding a cut window may differ at its edges
    assert len(counted) == 4
    assert all(abs(n - m) <= 2 for n, m in zip(counted, [8, 8, 24, 24], strict=True))
    runs = measured["runs"]
    assert [len(runs[k]) for k in ("decode", "prefill_500", "prefill_1500")] == [2, 2, 2]
    for run in runs["prefill_500"]:
        assert run["error"] is None and 450 <= run["prompt_tokens"] <= 550
        # ttft_ms is rounded to 0.1 ms, and the fake server answers in about 1 ms
        ttft = run["ttft_ms"]
        low, high = (run["prompt_tokens"] * 1000 / (ttft + d) for d in (0.05, -0.05))
        assert low * 0.999 <= run["prompt_tokens_per_s"] <= high * 1.001
    single = measured["single"]
    assert single["decode_tokens_per_s"] == pytest.approx(1000 / single["itl_ms"], rel=0.05)
    assert measured["concurrency"][0]["requests"] == 4
    assert measured["rss_mb"]["unavailable"].startswith("external server")


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
