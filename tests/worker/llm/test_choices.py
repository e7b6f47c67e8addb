"""n > 1 choices sharing one prefill, and logprobs, on the tiny decoder (real onnxruntime,
SmolLM2's real tokenizer)."""

from __future__ import annotations

import asyncio
import math

import pytest

from common.errors import InvalidArgument
from worker.llm.engine import LENGTH, Engine, Output, Sequence
from worker.llm.sampling import SamplingParams, build

PROMPT = [(i * 37) % 900 + 20 for i in range(40)]  # two whole prefix-cache blocks and more


async def collect(engine: Engine, seqs: list[Sequence]) -> list[Output]:
    return [out async for out in engine.stream(seqs)]


def texts(outs: list[Output], n: int) -> list[str]:
    return ["".join(o.text for o in outs if o.index == i) for i in range(n)]


def test_greedy_choices_are_identical_and_the_prompt_is_prefilled_once(make_engine) -> None:  # type: ignore[no-untyped-def]
    p = build({"n": 3, "temperature": 0, "max_tokens": 10, "ignore_eos": True}, 200)

    async def main() -> tuple[list[Output], Engine]:
        async with make_engine() as engine:
            outs = await collect(engine, engine.add_choices(PROMPT, p))
            return outs, engine

    outs, engine = asyncio.run(main())
    got = texts(outs, 3)
    assert got[0] and got[0] == got[1] == got[2]
    ends = [o for o in outs if o.finished]
    assert sorted(o.index for o in ends) == [0, 1, 2]
    assert all(o.finish_reason == LENGTH and o.completion_tokens == 10 for o in ends)
    assert [o.final for o in outs] == [False] * (len(outs) - 1) + [True]  # after every choice
    assert engine.stats.prefill_tokens == len(PROMPT)  # once, by the first choice
    assert engine.stats.first_from_cache == 2  # the others sampled from its kept row
    assert engine.kv.stats.cached_tokens == 2 * len(PROMPT)


def test_seeded_choice_i_draws_as_seed_plus_i(make_engine, speculative_graphs) -> None:  # type: ignore[no-untyped-def]
    values = {"temperature": 1.5, "max_tokens": 12, "ignore_eos": True, "seed": 7}

    async def main() -> tuple[list[str], list[str]]:
        async with make_engine(speculative_graphs["target"]) as engine:  # a varied writer
            together = texts(
                await collect(engine, engine.add_choices(PROMPT, build({**values, "n": 3}, 200))), 3
            )
            alone = []
            for i in range(3):
                seq = engine.add(PROMPT, build({**values, "seed": 7 + i}, 200))
                alone.append("".join(o.text for o in await collect(engine, [seq])))
            return together, alone

    together, alone = asyncio.run(main())
    assert together == alone
    assert len(set(together)) > 1


def check_logprobs(outs: list[Output], top: int, greedy: bool) -> None:
    entries = [e for o in outs for e in o.logprobs or []]
    assert len(entries) == outs[-1].completion_tokens
    for e in entries:
        assert math.isfinite(e["logprob"]) and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == top
        alternatives = [a["logprob"] for a in e["top_logprobs"]]
        assert alternatives == sorted(alternatives, reverse=True)
        assert all(math.isfinite(a) and a <= 0 for a in alternatives)
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        mine = [a for a in e["top_logprobs"] if a["id"] == e["id"]]
        if greedy:  # the sampled token is the most likely one
            assert mine and mine[0]["logprob"] == e["logprob"] == alternatives[0]
        elif mine:
            assert mine[0]["logprob"] == e["logprob"]


def test_logprobs_of_each_token_with_its_top_alternatives(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> tuple[list[Output], list[Output], list[Output]]:
        async with make_engine() as engine:
            await asyncio.to_thread(engine.vocab.ready)
            greedy = build(
                {"temperature": 0, "max_tokens": 16, "ignore_eos": True, "logprobs": 5}, 200
            )
            sampled = build(
                {
                    "temperature": 0.8,
                    "seed": 3,
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "logprobs": 2,
                },
                200,
            )
            own = build({"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": 0}, 200)
            outs = await asyncio.gather(
                *(collect(engine, [engine.add(PROMPT, p)]) for p in (greedy, sampled, own))
            )
            return outs[0], outs[1], outs[2]

    greedy, sampled, own = asyncio.run(main())
    check_logprobs(greedy, 5, greedy=True)
    check_logprobs(sampled, 2, greedy=False)
    check_logprobs(own, 0, greedy=False)


def test_rows_without_logprobs_get_none_and_keep_the_graph_top_k(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> tuple[list[Output], int]:
        async with make_engine() as engine:
            outs = await collect(
                engine,
                [
                    engine.add(
                        PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                    )
                ],
            )
            return outs, engine.stats.top_runs

    outs, top_runs = asyncio.run(main())
    assert all(o.logprobs is None for o in outs)


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"n": 0}, "'n' = 0: must be >= 1 and <= 16"),
        ({"n": 17}, "'n' = 17: must be >= 1 and <= 16"),
        ({"n": "two"}, "'n': expected a number"),
        ({"logprobs": -1}, "'logprobs' = -1: must be >= 0 and <= 20"),
        ({"logprobs": 21}, "'logprobs' = 21: must be >= 0 and <= 20"),
    ],
)
def test_bad_n_and_logprobs_are_refused_by_name(values: dict, names: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        build(values, 200)
    assert names in str(e.value)
