"""Resuming a generation from the ids it had produced (llm_protocol.RESUME_TOKEN_IDS), on
tiny random decoders (real onnxruntime, real tokenizer): the continuation is the rest of the
uninterrupted run, token for token and text for text, with counts that go on from the cut."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenizers import Tokenizer

from common.errors import InvalidArgument
from worker.llm.detokenize import Detokenizer
from worker.llm.engine import Engine, Output, Sequence
from worker.llm.sampling import SamplingParams

PROMPT = [17, 420, 9001, 33, 5]
CASES = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    # seeded sampling with penalties and min_tokens: the sampler's state goes on from the cut
    "seeded": SamplingParams(
        max_tokens=40,
        temperature=1.5,
        top_k=50,
        seed=5,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        min_tokens=30,
    ),
    "nucleus": SamplingParams(max_tokens=40, temperature=2.0, top_p=0.9, seed=9, ignore_eos=True),
}


async def collect(engine: Engine, seq: Sequence) -> list[Output]:
    return [out async for out in engine.stream(seq)]


def run(make_engine, graph, params: SamplingParams, resumes: list[list[int]]):  # type: ignore[no-untyped-def]
    """The uninterrupted run's outputs, then each resumed run's (one after the other)."""

    async def main():  # type: ignore[no-untyped-def]
        async with make_engine(graph=graph) as engine:
            first = await collect(engine, engine.add(PROMPT, params))
            rest = [await collect(engine, engine.add(PROMPT, params, resume=r)) for r in resumes]
            return first, rest

    return asyncio.run(main())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_generation_is_the_rest_of_the_uninterrupted_one(  # type: ignore[no-untyped-def]
    make_engine, speculative_graphs, case: str
) -> None:
    params = CASES[case]
    full, _ = run(make_engine, speculative_graphs["target"], params, [])
    ids = [t for out in full for t in out.token_ids]
    text = "".join(out.text for out in full)
    assert len(ids) == full[-1].completion_tokens == params.max_tokens
    # cut after pieces 1, a middle one and the one before last, as a router would
    cuts = sorted({1, len(full) // 2, len(full) - 2})
    _, resumed = run(
        make_engine,
        speculative_graphs["target"],
        params,
        [ids[: full[c - 1].completion_tokens] for c in cuts],
    )
    for c, outs in zip(cuts, resumed, strict=True):
        sent = full[c - 1].completion_tokens
        assert [t for out in outs for t in out.token_ids] == ids[sent:]
        assert "".join(o.text for o in full[:c]) + "".join(o.text for o in outs) == text
        assert [o.completion_tokens for o in outs] == [o.completion_tokens for o in full[c:]]
        assert {o.prompt_tokens for o in outs} == {len(PROMPT)}  # billed once
        assert outs[-1].finish_reason == full[-1].finish_reason


def test_a_resume_with_nothing_left_or_ids_outside_the_vocabulary_is_refused(make_engine) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def main() -> None:
        async with make_engine() as engine:
            with pytest.raises(InvalidArgument, match="resume_token_ids.*nothing is left"):
                engine.add(PROMPT, params, resume=[1, 2, 3, 4])
            with pytest.raises(InvalidArgument, match="outside the vocabulary"):
                engine.add(PROMPT, params, resume=[1, 10**9])

    asyncio.run(main())


def test_detokenizing_resumes_mid_character_and_mid_stop_string(
    smollm2_tokenizer: Tokenizer,
) -> None:
    """Every cut of a text whose characters span several byte-level tokens, with a stop
    string held back across the cut: a detokenizer fed the ids before the cut, their text
    dropped (as a resumed sequence does), sends exactly the rest."""
    text = "Naïve café: 日本語のテキスト 🙂🚀 and the END of it"
    ids = smollm2_tokenizer.encode(text).ids
    stop = ("END",)

    def stream(tokens: list[int], replayed: list[int]) -> str:
        d = Detokenizer(smollm2_tokenizer, stop, skip_special=True)
        for t in replayed:  # as a resumed sequence's earlier ids: their text was sent
            d.add(t)
        return "".join(d.add(t) for t in tokens) + d.finish()

    whole = stream(ids, [])
    assert whole == text[: text.index("END")]
    for cut in range(1, len(ids)):
        d = Detokenizer(smollm2_tokenizer, stop, skip_special=True)
        sent = "".join(d.add(t) for t in ids[:cut])
        if d.stopped:
            break
        assert sent + stream(ids[cut:], ids[:cut]) == whole, cut


def test_the_resume_parameter_is_a_bounded_json_list_of_ids() -> None:
    from common import llm_protocol
    from worker.llm.serving import _resume

    name = llm_protocol.RESUME_TOKEN_IDS
    assert _resume({}) == [] and _resume({name: "[3, 1, 4]"}) == [3, 1, 4]
    too_many = json.dumps([1] * (llm_protocol.MAX_RESUME_TOKEN_IDS + 1))
    for bad in ("[1, 2", '{"a": 1}', "[1.5]", '["7"]', 5, too_many):
        with pytest.raises(InvalidArgument, match="resume_token_ids.*JSON list"):
            _resume({name: bad})
