"""Decode runs chained on the step thread (EngineConfig.num_scheduler_steps): the step thread
samples each run and starts the next at once while the event loop emits the tokens. The
tokens are those of the scheduler deciding every step; an arrival, a cancel, a stop string
or a row's end stops the chain within a run; an ended row's slot is given back once it stops."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from quantize import llm_graph
from quantize.models import LlamaDecoder
from worker.llm.engine import CANCELLED, LENGTH, STOP, Engine, Output, Sequence
from worker.llm.sampling import SamplingParams

PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.0, min_tokens=6),
    SamplingParams(max_tokens=24, temperature=0.9, top_k=5, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.7, top_k=64, seed=2, min_tokens=4),
    SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=22, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
]
PROMPTS = [[17, 420, 9001, 33, 5], [5, 6, 7, 8, 9, 10, 11], [300, 301], [42] * 9]


async def collect(engine: Engine, seq: Sequence) -> list[Output]:
    return [out async for out in engine.stream(seq)]


# decode runs the step thread may have sampled whose tokens the event loop has not taken
IN_FLIGHT = 6


def run(make_engine, graph: Path, steps: int) -> tuple[list[list[int]], list[str], Engine]:  # type: ignore[no-untyped-def]
    """Every PARAMS x PROMPTS request at once (rows of one run sampling different ways)."""

    async def main() -> tuple[list[list[int]], list[str], Engine]:
        async with make_engine(
            graph, max_num_seqs=32, kv_cache_tokens=4096, num_scheduler_steps=steps
        ) as engine:
            seqs = [engine.add(p, s) for s in PARAMS for p in PROMPTS]
            outs = await asyncio.gather(*(collect(engine, s) for s in seqs))
            texts = ["".join(o.text for o in out) for out in outs]
            return [s.tokens for s in seqs], texts, engine

    return asyncio.run(main())


def test_chained_runs_give_the_tokens_and_text_of_one_step_at_a_time(  # type: ignore[no-untyped-def]
    make_engine, speculative_graphs
) -> None:
    graph = speculative_graphs["target"]  # varied tokens, its own top-64
    tokens, texts, chained = run(make_engine, graph, 64)
    one_tokens, one_texts, one = run(make_engine, graph, 1)
    assert tokens == one_tokens
    assert texts == one_texts
    s, o = chained.stats, one.stats
    assert s.decode_tokens == o.decode_tokens and s.finished == o.finished
    # one decision a run without a chain; with one, runs go on between the rows' ends
    assert o.steps >= o.decode_runs
    assert s.steps < s.decode_runs
    assert s.top_runs > 0 and s.top_runs < s.decode_runs  # penalties and top_p read logits


def test_min_tokens_holds_eos_back_to_the_token_in_chained_runs(  # type: ignore[no-untyped-def]
    make_engine, tiny_decoder: LlamaDecoder, smollm2_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """A decoder whose best token is always EOS (one embedding dimension every token shares,
    EOS's far the largest): EOS is banned for the first min_tokens tokens, sampled on the
    step thread, and taken at once after, chained or not."""
    eos = smollm2_tokenizer.token_to_id("<|im_end|>")
    decoder = copy.deepcopy(tiny_decoder)
    with torch.no_grad():
        decoder.embed.weight[:, 0] = 1.0
        decoder.embed.weight[eos, 0] = 500.0
    graph = llm_graph.save(llm_graph.build(decoder, 512), tmp_path / "eos.onnx")
    params = SamplingParams(max_tokens=40, temperature=0.0, min_tokens=7)

    async def main(steps: int) -> list[Output]:
        async with make_engine(graph, num_scheduler_steps=steps) as engine:
            return await collect(engine, engine.add([17, 420, 9], params))

    for steps in (64, 1):
        last = asyncio.run(main(steps))[-1]
        assert last.finish_reason == STOP, steps
        assert last.completion_tokens == 8, steps


def test_a_stop_string_stops_the_chain_and_gives_the_slot_back(  # type: ignore[no-untyped-def]
    make_engine, smollm2_tokenizer: Tokenizer
) -> None:
    """A stop string only the event loop's detokenizer sees: the text is cut before it, no
    token after it joins the sequence, the runs stop, and its slot and budget come back."""
    word = smollm2_tokenizer.encode(" river").ids
    assert len(word) == 1
    params = SamplingParams(max_tokens=60, temperature=0.0, stop=("river river",))

    async def main() -> None:
        async with make_engine(num_scheduler_steps=64) as engine:
            seq = engine.add([17, 420, *word], params)
            outs = await collect(engine, seq)
            assert outs[-1].finish_reason == STOP
            assert "".join(o.text for o in outs) == " "  # " river river" cut before "river"
            assert len(seq.tokens) == outs[-1].completion_tokens == 2
            while engine.kv.reserved_tokens:  # given back when the runs stop
                await asyncio.sleep(0.001)
            assert engine.kv.free_slots == 4
            assert not engine.running
            assert engine.stats.decode_runs < 30  # not on to max_tokens

    asyncio.run(main())


def test_an_arrival_and_a_cancel_stop_the_chain_within_a_run(make_engine) -> None:  # type: ignore[no-untyped-def]
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with make_engine(num_scheduler_steps=64) as engine:
            a = engine.add([11, 22, 33, 44], long)
            reader = asyncio.create_task(collect(engine, a))
            while len(a.tokens) < 5:
                await asyncio.sleep(0.001)
            b, at = engine.add([500, 600, 700], long), len(a.tokens)
            stream = engine.stream(b)
            await anext(stream)  # b's first token
            # a's runs stopped within a run of b's arrival (a chain going on would run 64);
            # the slack: tokens the step thread had sampled but the event loop had not yet
            # taken when `at` was read (more on a loaded machine)
            assert len(a.tokens) <= at + 3 + IN_FLIGHT
            await stream.aclose()  # b's client leaves: a cancel
            while b.finish_reason is None:
                await asyncio.sleep(0.001)
            assert b.finish_reason == CANCELLED
            before = len(a.tokens)
            while engine.kv.free_slots != 3:
                await asyncio.sleep(0.001)
            assert len(a.tokens) <= before + 3 + IN_FLIGHT  # given back within a run or two
            outs = await reader
            assert outs[-1].finish_reason == LENGTH and len(a.tokens) == 200

    asyncio.run(main())


def test_a_run_that_fails_mid_chain_fails_its_rows_and_the_engine_serves_on(  # type: ignore[no-untyped-def]
    make_engine,
) -> None:
    """The step graph's 10th run raises (a fault injected around the real session): the
    chained rows end with that error and no token after it, their slots come back, and the
    next request is served whole."""
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with make_engine(num_scheduler_steps=64) as engine:
            model, calls = engine.model, []
            real = model.run_top

            def run_top(*args):  # type: ignore[no-untyped-def]
                calls.append(1)
                if len(calls) == 10:
                    raise RuntimeError("injected failure")
                return real(*args)

            model.run_top = run_top
            a, b = engine.add([11, 22, 33], params), engine.add([44, 55, 66], params)
            outs = await asyncio.gather(collect(engine, a), collect(engine, b))
            for out in outs:
                assert [o.finished for o in out].count(True) == 1 and out[-1].finished
                assert out[-1].finish_reason == "error"
                assert "injected failure" in (out[-1].error or "")
                assert out[-1].completion_tokens < 50
            assert len(a.tokens) == outs[0][-1].completion_tokens  # none joined after
            assert engine.kv.reserved_tokens == 0 and not engine.running
            c = engine.add([77, 88], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
            last = (await collect(engine, c))[-1]
            assert last.finish_reason == LENGTH and last.completion_tokens == 5

    asyncio.run(main())


def test_num_scheduler_steps_below_one_is_refused_by_name(make_engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with make_engine(num_scheduler_steps=0):
            pass

    with pytest.raises(ValueError, match="num_scheduler_steps 0: must be >= 1"):
        asyncio.run(main())
