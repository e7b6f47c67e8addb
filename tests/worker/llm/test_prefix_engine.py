"""The prefix cache in the engine (tiny random decoder, real onnxruntime): greedy output with
a hit equals the output without one, token for token, for a prefix ending mid-block, a
wholly cached prompt (served with no run) and a conversation's next turn
(test_prefix_exact.py: the real quantized model, where a near-tie would show a difference);
sharers prefill once; a sequence cancelled mid-prefill leaves nothing to serve; eviction
under a small budget."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from worker.llm.engine import Engine, Output, Sequence
from worker.llm.prefix import root_key
from worker.llm.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ROOT = root_key("tiny", "1")
SYSTEM = [(7 * i + 3) % 5000 + 10 for i in range(40)]  # 2 whole blocks and 8 tokens


async def run(engine: Engine, prompt: list[int], root: bytes = ROOT) -> tuple[list[int], Output]:
    seq = engine.add(prompt, GREEDY, root)
    outs = [out async for out in engine.stream(seq)]
    return seq.tokens, outs[-1]


async def drain(engine: Engine, seq: Sequence) -> list[Output]:
    return [out async for out in engine.stream(seq)]


def uncached(make_engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    async def main() -> list[list[int]]:
        async with make_engine(prefix_caching=False) as engine:
            return [(await run(engine, p))[0] for p in prompts]

    return asyncio.run(main())


def test_a_hit_changes_no_token_mid_block_wholly_cached_and_next_turn(make_engine) -> None:  # type: ignore[no-untyped-def]
    first = SYSTEM[:37]  # ends mid-block
    longer = [*SYSTEM, 99, 98]

    async def main() -> tuple[list[list[int]], list[int], Engine, list[int]]:
        async with make_engine() as engine:
            tokens, cached = [], []
            for prompt in (first, longer, longer):
                t, out = await run(engine, prompt)
                tokens.append(t)
                cached.append(out.cached_tokens)
            # the next turn of the conversation: its history (prompt + answer) and more
            turn = [*longer, *tokens[-1], 5, 6, 7]
            t, out = await run(engine, turn)
            tokens.append(t)
            cached.append(out.cached_tokens)
            return tokens, cached, engine, turn

    tokens, cached, engine, turn = asyncio.run(main())
    assert cached[0] == 0
    assert cached[1] == 37  # two whole blocks and 5 tokens past them: to the token
    # wholly cached: no run at all, the first token sampled from the row the prompt's own
    # run gave for its last position
    assert cached[2] == len(longer)
    assert engine.stats.first_from_cache == 1
    # the next turn: the previous prompt's rows (its answer's, computed one token per run,
    # are computed again, as a cold prefill would)
    assert cached[3] == len(longer)
    assert engine.kv.stats.moved_tokens >= len(longer)  # finished prompts were kept
    # each hit's rows were copied into its own slot, and the copies' time is counted
    assert engine.stats.copied_rows >= sum(cached) and engine.stats.copy_ns > 0
    assert tokens == uncached(make_engine, [first, longer, longer, turn])
    assert engine.stats.prefill_tokens == 37 + (len(longer) - 37) + (len(turn) - cached[3])


def test_a_salt_or_another_version_never_shares(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[int]:
        async with make_engine() as engine:
            await run(engine, SYSTEM)
            outs = [await run(engine, SYSTEM, root) for root in (root_key("tiny", "2"),)]
            outs.append(await run(engine, SYSTEM, root_key("tiny", "1", salt="tenant-b")))
            outs.append(await run(engine, SYSTEM))
            return [o.cached_tokens for _, o in outs]

    assert asyncio.run(main()) == [0, 0, len(SYSTEM)]


def test_concurrent_sharers_prefill_the_shared_prompt_once(make_engine) -> None:  # type: ignore[no-untyped-def]
    prompts = [[*SYSTEM, *SYSTEM[:8], 100 + i, 200 + i] for i in range(3)]  # 3 whole blocks shared

    async def main() -> tuple[list[list[int]], list[int], Engine]:
        async with make_engine(prefill_chunk=16, max_step_tokens=64) as engine:
            seqs = [engine.add(p, GREEDY, ROOT) for p in prompts]  # admitted in one step
            outs = await asyncio.gather(*(drain(engine, s) for s in seqs))
            return [s.tokens for s in seqs], [o[-1].cached_tokens for o in outs], engine

    tokens, cached, engine = asyncio.run(main())
    assert cached[0] == 0 and cached[1] >= 48 and cached[2] >= 48
    assert engine.stats.prefill_tokens <= len(prompts[0]) + 2 * (len(prompts[0]) - 48)
    assert tokens == uncached(make_engine, prompts)


def test_a_sequence_cancelled_mid_prefill_leaves_nothing_to_serve(make_engine) -> None:  # type: ignore[no-untyped-def]
    prompt = [(13 * i) % 4000 + 20 for i in range(160)]

    async def main() -> tuple[list[int], int, Engine]:
        async with make_engine(prefill_chunk=16) as engine:
            seq: Sequence = engine.add(prompt, GREEDY, ROOT)
            while seq.computed < 32:  # two chunks in, far from the end
                await asyncio.sleep(0.001)
            engine.cancel(seq)
            async for _ in engine.stream(seq):
                pass
            assert engine.kv.get_computed(ROOT, prompt).tokens == 0
            tokens, out = await run(engine, prompt)
            return tokens, out.cached_tokens, engine

    tokens, cached, engine = asyncio.run(main())
    assert cached == 0
    assert tokens == uncached(make_engine, [prompt])[0]


def test_eviction_under_a_small_budget_keeps_every_answer_exact(make_engine) -> None:  # type: ignore[no-untyped-def]
    prompts = [[*SYSTEM[: 16 + 8 * (i % 3)], 300 + i, *range(40 + i, 70 + i)] for i in range(8)]

    async def main() -> tuple[list[list[int]], Engine]:
        async with make_engine(max_num_seqs=2, kv_cache_tokens=160) as engine:
            out = []
            for i in range(0, len(prompts), 2):
                pair = await asyncio.gather(*(run(engine, p) for p in prompts[i : i + 2]))
                out += [t for t, _ in pair]
                p = engine.kv
                assert p.reserved_tokens + p.retained_tokens <= p.budget_tokens
            return out, engine

    tokens, engine = asyncio.run(main())
    assert engine.kv.stats.evicted_blocks > 0 and engine.kv.stats.hits > 0
    assert tokens == uncached(make_engine, prompts)


def test_a_whole_prompt_samples_from_the_kept_row_seed_for_seed(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Sampled with a seed and a penalty (the sampler adjusts a logits row in place): the
    whole prompt again runs nothing and gives the cold run's tokens. A greedy run keeps only
    the graph's top-k; a sampler that needs every logit then runs the last two tokens."""
    seeded = SamplingParams(
        max_tokens=8, temperature=0.9, seed=11, repetition_penalty=1.3, ignore_eos=True
    )
    prompt = [*SYSTEM, 61, 62, 63]
    other = [*SYSTEM, 71, 72]

    async def go(engine: Engine, p: list[int], params: SamplingParams) -> Sequence:
        seq = engine.add(p, params, ROOT)
        await drain(engine, seq)
        return seq

    def kept(engine: Engine) -> np.ndarray:
        last = engine.kv.get_computed(ROOT, prompt, lambda row: True).last
        assert isinstance(last, np.ndarray)  # the logits: this sampler needs them all
        return last.copy()

    async def cached() -> tuple[list[Sequence], Engine]:
        async with make_engine() as engine:
            seqs = [await go(engine, prompt, seeded)]
            row = kept(engine)
            seqs += [await go(engine, prompt, seeded) for _ in range(2)]
            assert np.array_equal(kept(engine), row)  # sampling from it changed nothing kept
            seqs.append(await go(engine, other, GREEDY))  # keeps the top-k only
            seqs.append(await go(engine, other, seeded))  # needs the logits: reruns two
            return seqs, engine

    async def cold() -> list[list[int]]:
        async with make_engine(prefix_caching=False) as engine:
            return [(await go(engine, p, s)).tokens for p, s in ((prompt, seeded), (other, seeded))]

    seqs, engine = asyncio.run(cached())
    want, want_other = asyncio.run(cold())
    assert [s.tokens for s in seqs[:3]] == [want] * 3
    assert [s.cached for s in seqs[:3]] == [0, len(prompt), len(prompt)]
    assert seqs[4].tokens == want_other and seqs[4].cached == len(other) - 2
    assert engine.stats.first_from_cache == 2
