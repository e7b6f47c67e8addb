"""The engine on a tiny random decoder (real onnxruntime, real tokenizer): scheduling,
continuous batching, cancellation, admission, sampling determinism."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from common.errors import InvalidArgument, ResourceExhausted
from quantize.models import LlamaDecoder, greedy
from worker.llm.engine import CANCELLED, LENGTH, Engine, Output, Sequence
from worker.llm.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def collect(engine: Engine, seq: Sequence) -> list[Output]:
    return [out async for out in engine.stream(seq)]


def test_greedy_tokens_equal_the_torch_reference(make_engine, tiny_decoder: LlamaDecoder) -> None:  # type: ignore[no-untyped-def]
    prompt = [17, 420, 9001, 33, 5]

    async def main() -> list[int]:
        async with make_engine() as engine:
            seq = engine.add(prompt, GREEDY)
            outs = await collect(engine, seq)
            assert outs[-1].finished and outs[-1].finish_reason == LENGTH
            assert outs[-1].prompt_tokens == 5 and outs[-1].completion_tokens == 12
            return seq.tokens

    reference = greedy(tiny_decoder, torch.tensor([prompt]), 12)
    assert asyncio.run(main()) == reference


def test_a_request_joining_mid_generation_shares_steps_and_changes_no_tokens(make_engine) -> None:  # type: ignore[no-untyped-def]
    first, second = [11, 22, 33, 44], [5, 6, 7, 8, 9, 10, 11]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def alone(prompt: list[int]) -> list[int]:
        async with make_engine() as engine:
            seq = engine.add(prompt, long)
            await collect(engine, seq)
            return seq.tokens

    async def together() -> tuple[list[int], list[int], Engine]:
        async with make_engine() as engine:
            a = engine.add(first, long)
            task = asyncio.create_task(collect(engine, a))
            while len(a.tokens) < 10:  # the first is well into its generation
                await asyncio.sleep(0.001)
            b = engine.add(second, long)
            await asyncio.gather(task, collect(engine, b))
            assert len(a.tokens) >= 10
            return a.tokens, b.tokens, engine

    a_alone, b_alone = asyncio.run(alone(first)), asyncio.run(alone(second))
    a_tokens, b_tokens, engine = asyncio.run(together())
    assert a_tokens == a_alone
    assert b_tokens == b_alone
    assert engine.stats.joined_running == 1
    assert engine.stats.decode_batches[2] > 0  # decode steps that ran both sequences at once
    assert engine.stats.decode_batches[1] > 0


def test_cancel_frees_the_slot_and_the_budget_within_a_step(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with make_engine(max_model_len=512, max_num_seqs=2, kv_cache_tokens=1024) as engine:
            params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            seq = engine.add([1, 2, 3], params)
            reader = asyncio.create_task(collect(engine, seq))
            while len(seq.tokens) < 3:
                await asyncio.sleep(0.001)
            assert engine.kv.reserved_tokens == 503 and engine.kv.free_slots == 1
            steps = engine.stats.steps
            reader.cancel()  # the client went away
            while seq.finish_reason is None:
                await asyncio.sleep(0.001)
            assert seq.finish_reason == CANCELLED
            assert engine.stats.steps <= steps + 2
            assert engine.kv.reserved_tokens == 0 and engine.kv.free_slots == 2
            assert engine.stats.finished[CANCELLED] == 1

    asyncio.run(main())


def test_admission_waits_for_kv_budget_and_refuses_what_can_never_fit(make_engine) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=85, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with make_engine(max_num_seqs=4, kv_cache_tokens=100, max_waiting=1) as engine:
            a = engine.add([1] * 10, params)  # reserves 95 of 100 tokens
            while a not in engine.running:
                await asyncio.sleep(0.001)
            b = engine.add([2] * 10, params)  # does not fit next to a: waits
            await asyncio.sleep(0.005)
            assert len(a.tokens) < 85, "the first finished before the check; use a longer one"
            assert a in engine.running and b in engine.waiting
            assert engine.kv_used_tokens == 95
            with pytest.raises(ResourceExhausted, match="already waiting"):
                engine.add([3] * 5, params)  # the waiting queue (max 1) is full
            with pytest.raises(InvalidArgument, match="exceeds the KV cache budget of 100"):
                engine.add([4] * 50, params)
            await collect(engine, a)
            outs = await collect(engine, b)  # admitted once a finished
            assert outs[-1].completion_tokens == 85

    asyncio.run(main())


def test_prompt_longer_than_max_model_len_is_refused_with_both_numbers(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with make_engine(max_model_len=64) as engine:
            with pytest.raises(InvalidArgument, match=r"prompt is 80 tokens; max_model_len is 64"):
                engine.add(list(range(80)), GREEDY)
            with pytest.raises(InvalidArgument, match=r"token id 99999 is outside"):
                engine.add([1, 99999], GREEDY)

    asyncio.run(main())


def test_generation_stops_at_max_model_len(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with make_engine(max_model_len=32) as engine:
            seq = engine.add(
                list(range(1, 21)), SamplingParams(max_tokens=31, temperature=0.0, ignore_eos=True)
            )
            outs = await collect(engine, seq)
            assert outs[-1].finish_reason == LENGTH
            assert seq.length == 32 and len(seq.tokens) == 12

    asyncio.run(main())


def test_same_seed_same_tokens_other_seed_other_tokens(make_engine) -> None:  # type: ignore[no-untyped-def]
    def params(seed: int) -> SamplingParams:
        # the tiny random model is very peaked: a high temperature makes sampling visible
        return SamplingParams(
            max_tokens=24, temperature=20.0, top_p=0.95, seed=seed, ignore_eos=True
        )

    async def main() -> list[list[int]]:
        async with make_engine() as engine:
            seqs = [engine.add([1, 2, 3], params(s)) for s in (7, 7, 8)]
            await asyncio.gather(*(collect(engine, s) for s in seqs))
            return [s.tokens for s in seqs]

    a, b, c = asyncio.run(main())
    assert a == b
    assert a != c


def test_long_prompt_is_prefilled_in_chunks_while_another_stream_decodes(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with make_engine(prefill_chunk=16) as engine:
            a = engine.add(
                [1, 2, 3], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
            )
            task = asyncio.create_task(collect(engine, a))
            while not a.tokens:
                await asyncio.sleep(0.001)
            before = len(a.tokens)
            b = engine.add(list(range(10, 110)), SamplingParams(max_tokens=4, temperature=0.0))
            while b.prefilling:
                await asyncio.sleep(0.001)
            # 100 prompt tokens in chunks of 16: 7 steps, each of which also decoded `a`
            assert engine.stats.prefill_runs >= 1 + 7
            assert len(a.tokens) - before >= 6
            await asyncio.gather(task, collect(engine, b))

    asyncio.run(main())


def test_sampler_top_k_one_is_greedy() -> None:
    from worker.llm.sampling import Sampler

    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=1, seed=3), [1, 2], 1000)
    assert all(sampler.sample(logits.copy()) == int(logits.argmax()) for _ in range(5))


def test_step_logits_survive_the_next_step(tiny_step_graph) -> None:  # type: ignore[no-untyped-def]
    """run() returns its own array: the IO binding's output buffer is reused by the next run."""
    from worker.llm.cache import CacheShape, KVCache
    from worker.llm.model import StepModel
    from worker.runtime import RuntimeOptions

    model = StepModel.load(tiny_step_graph, RuntimeOptions(), ["CPUExecutionProvider"])
    f = model.facts
    cache = KVCache(CacheShape(f.layers, f.kv_heads, f.head_dim, 1, 64))
    first = model.run(cache, np.array([[5, 6, 7]]), np.array([3]), 0, 1)
    kept = first.copy()
    model.run(cache, np.array([[8]]), np.array([4]), 0, 1)
    assert np.array_equal(first, kept)
    cache.close()


def test_sampler_follows_the_distribution_and_cuts_the_nucleus() -> None:
    from worker.llm.sampling import Sampler

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    full = Sampler(SamplingParams(temperature=1.0, seed=1), [], 4)
    counts = np.bincount([full.sample(logits.copy()) for _ in range(4000)], minlength=4) / 4000
    assert np.allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1), [], 4)
    picked = {nucleus.sample(logits.copy()) for _ in range(500)}
    assert picked == {0, 1}  # 0.5 + 0.3 >= 0.7: the two most likely tokens only
    penalized = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0), [], 4)
    penalized.observe(0)
    assert penalized.sample(logits.copy()) == 1  # token 0 was already said
