"""Structured output on the real model (SmolLM2 int8, the graph `make run` serves): what a
grammar allows is all that comes out, and it ends where the grammar does; and on the tiny
decoder, with chained decode runs and n-gram speculation, which a constrained row skips."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from common.errors import InvalidArgument
from tests.worker.llm.test_prefix_exact import chat, engine_for
from worker.llm.engine import STOP, Engine, Output
from worker.llm.guided import parse
from worker.llm.sampling import SamplingParams, build
from worker.llm.speculative import NgramConfig

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


def params(**values: object) -> SamplingParams:
    return build({"temperature": 0, "max_tokens": 120, **values}, 400)


async def answer(engine: Engine, prompt: list[int], p: SamplingParams) -> tuple[str, Output]:
    outs = [out async for out in engine.stream(engine.add(prompt, p))]
    return "".join(o.text for o in outs), outs[-1]


@pytest.mark.slow
def test_each_guided_kind_yields_what_its_grammar_allows(smollm2: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))

    def ask(question: str) -> list[int]:
        return tokenizer.encode(chat(question)).ids  # type: ignore[no-any-return]

    async def main() -> dict[str, tuple[str, Output]]:
        async with engine_for(smollm2) as engine:
            await asyncio.to_thread(engine.vocab.ready)
            cases = {
                "json": (ask("Describe a person as JSON."), params(guided_json=PERSON)),
                "object": (
                    ask('Reply in JSON with one key, "capital": what is the capital of France?'),
                    params(guided_json_object=True),
                ),
                "regex": (
                    ask("What is a phone number I can call?"),
                    params(guided_regex=r"\(\d{3}\) \d{3}-\d{4}"),
                ),
                "choice": (
                    ask("What is the capital of France?"),
                    params(guided_choice=["Paris", "London", "Berlin"]),
                ),
                "grammar": (
                    ask("Is the sky blue? Answer yes or no."),
                    params(guided_grammar='root ::= ("yes" | "no") "!"'),
                ),
            }
            done = await asyncio.gather(*(answer(engine, *c) for c in cases.values()))
            return dict(zip(cases, done, strict=True))

    got = asyncio.run(main())
    for kind, (_, last) in got.items():
        assert last.finish_reason == STOP, kind  # the grammar's end, not max_tokens
    jsonschema.validate(json.loads(got["json"][0]), PERSON)
    assert isinstance(json.loads(got["object"][0]), dict)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", got["regex"][0])
    assert got["choice"][0] in ("Paris", "London", "Berlin")
    assert got["grammar"][0] in ("yes!", "no!")


def test_a_constrained_row_chains_and_never_speculates(make_engine, speculative_graphs) -> None:  # type: ignore[no-untyped-def]
    """Sampled rows of the tiny random decoder under a regex, through chained decode runs
    (each mask computed while the run before it executes) and an n-gram proposer that a
    lone constrained row does not use; an unconstrained row beside them still speculates."""
    pattern = r"[a-z]{3,8}( [a-z]{3,8}){4}\."

    async def main() -> tuple[list[str], int, int]:
        graph, ngram = speculative_graphs["verify"], NgramConfig(3, 1, 3)
        async with make_engine(graph, ngram=ngram, num_scheduler_steps=8) as engine:
            await asyncio.to_thread(engine.vocab.ready)
            texts = []
            for seed in range(3):
                p = build(
                    {"temperature": 1.0, "seed": seed, "max_tokens": 60, "guided_regex": pattern},
                    200,
                )
                text, last = await answer(engine, [5, 6, 7, 5, 6, 7, 5, 6], p)
                assert last.finish_reason == STOP
                texts.append(text)
            constrained = engine.stats.draft_tokens
            free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
            await answer(engine, [5, 6, 7, 5, 6, 7, 5, 6], free)
            return texts, constrained, engine.stats.draft_tokens

    texts, constrained, after = asyncio.run(main())
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert constrained == 0 and after > 0


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"guided_json": {"type": "foo"}}, "'guided_json': expected a JSON schema"),
        ({"guided_json": "{not json"}, "'guided_json': expected a JSON schema"),
        ({"guided_json": [1, 2]}, "'guided_json': expected a JSON schema"),
        ({"guided_regex": "(("}, "'guided_regex': expected a regular expression"),
        ({"guided_choice": []}, "'guided_choice': expected a non-empty list"),
        ({"guided_choice": ["a", 3]}, "'guided_choice': expected a non-empty list"),
        ({"guided_grammar": "root ::= foo("}, "'guided_grammar': expected a Lark or GBNF"),
        ({"guided_json_object": "maybe"}, "'guided_json_object': expected true or false"),
        (
            {"guided_regex": "a+", "guided_choice": ["a"]},
            "['guided_regex', 'guided_choice']: at most one guided_* key",
        ),
    ],
)
def test_bad_grammars_are_refused_by_name(make_engine, values: dict, names: str) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with make_engine() as engine:
            p = build({"max_tokens": 4, **values}, 200)  # shape errors: here
            engine.add([5, 6, 7], p)  # the grammar's own errors: when compiled

    with pytest.raises(InvalidArgument) as e:
        asyncio.run(main())
    assert names in str(e.value)


def test_no_guided_key_means_no_grammar() -> None:
    assert parse({"guided_json_object": False, "max_tokens": 3}) is None
