"""The prefix cache on the real model (SmolLM2 int8, the graph `make run` serves): greedy output
with a hit equals the output without one, token for token, for a prefix that ends mid-block,
a wholly cached prompt and a hit that joins running streams (other chunk sizes, other decode
batches). Before the fix, a one-token run (the rerun last token of a hit) gave logits 0.5-0.9
away from the same token's inside a prefill chunk, which flipped greedy near-ties."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from worker.llm.engine import Engine, EngineConfig, Sequence
from worker.llm.model import StepModel
from worker.llm.prefix import root_key
from worker.llm.sampling import SamplingParams
from worker.runtime import RuntimeOptions

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
KEY = root_key("smollm2", "1")
CHAT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = (
    "Write a short story about a robot number 3.",
    "What is the capital of France, and why?",
    "List three uses of a prefix cache in a language model server.",
    "Explain rounding errors to a child.",
)


def chat(question: str) -> str:
    return f"{CHAT}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@contextlib.asynccontextmanager
async def engine_for(folder: Path, **overrides: object) -> AsyncIterator[Engine]:
    model = StepModel.load(
        folder / "1" / "model.onnx",
        RuntimeOptions(intra_op_threads=2, allow_spinning=False),
        ["CPUExecutionProvider"],
    )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    defaults: dict = {"max_model_len": 512, "max_num_seqs": 4, "kv_cache_tokens": 2048}
    engine = Engine(model, tokenizer, EngineConfig(**{**defaults, **overrides}))
    engine.start()
    try:
        yield engine
    finally:
        await engine.close()


async def generate(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> Sequence:
    seq = engine.add(prompt, params, KEY)
    async for _ in engine.stream(seq):
        pass
    return seq


def cold(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    async def main() -> list[list[int]]:
        async with engine_for(folder, prefix_caching=False) as engine:
            return [(await generate(engine, p)).tokens for p in prompts]

    return asyncio.run(main())


def prompts(folder: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tokenizer.encode(chat(q)).ids for q in QUESTIONS]


def test_a_mid_block_prefix_and_a_wholly_cached_prompt_change_no_token(smollm2: Path) -> None:
    full = prompts(smollm2)
    # each prompt's first part ends mid-block (not a multiple of 16 tokens), then the whole
    # prompt hits it to the token, then the whole prompt again is wholly cached
    cuts = [len(p) - 6 - (len(p) - 6) % 16 + 3 + 2 * i for i, p in enumerate(full)]
    parts = [p[:n] for n, p in zip(cuts, full, strict=True)]
    assert all(len(p) % 16 for p in parts)

    async def main() -> tuple[list[list[int]], list[int]]:
        async with engine_for(smollm2) as engine:
            tokens, cached = [], []
            for part, prompt in zip(parts, full, strict=True):
                for p in (part, prompt, prompt):
                    seq = await generate(engine, p)
                    tokens.append(seq.tokens)
                    cached.append(seq.cached)
            return tokens, cached

    tokens, cached = asyncio.run(main())
    want = cold(
        smollm2,
        [p for part, prompt in zip(parts, full, strict=True) for p in (part, prompt, prompt)],
    )
    assert tokens == want
    assert cached[1::3] == [len(p) for p in parts]  # to the token, mid-block
    assert cached[2::3] == [len(p) for p in full]  # wholly cached: no run, the kept row


def test_a_hit_joining_running_streams_changes_no_token(smollm2: Path) -> None:
    """Hits admitted while two streams decode: their chunks are cut by the step budget and
    their decode runs batch with other rows, yet every token is the cold run's alone."""
    full = prompts(smollm2)
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[list[list[int]], list[int]]:
        async with engine_for(smollm2, max_step_tokens=5, prefill_chunk=13) as engine:
            for i, p in enumerate(full):  # retained: what the hits below reuse
                await generate(engine, p[: -3 - i])
            streams = [asyncio.create_task(generate(engine, p, long)) for p in full[:2]]
            while len(engine.running) < 2 or min(len(s.tokens) for s in engine.running) < 3:
                await asyncio.sleep(0.005)
            hits = await asyncio.gather(*(generate(engine, p) for p in full[2:]))
            running = await asyncio.gather(*streams)
            assert engine.stats.decode_batches[4] + engine.stats.decode_batches[3] > 0
            return [s.tokens for s in (*running, *hits)], [s.cached for s in (*running, *hits)]

    tokens, cached = asyncio.run(main())
    alone = cold(smollm2, full)
    assert tokens[2:] == alone[2:]
    assert [t[:24] for t in tokens[:2]] == alone[:2]
    assert cached == [len(p) - 3 - i for i, p in enumerate(full)]
