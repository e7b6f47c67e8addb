"""Structured output, n > 1 choices, logprobs and token-id prompts through a real worker
process over gRPC (SmolLM2 int8), called as Triton vLLM-backend clients call it."""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as triton

from tests.integration.test_llm import MODEL, Stream, inputs, served, text_of

pytestmark = pytest.mark.slow
__all__ = ["served"]  # the module's worker, as test_llm.py's

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def params(result) -> dict:  # type: ignore[no-untyped-def]
    out = {}
    for key, p in result.get_response().parameters.items():
        out[key] = getattr(p, p.WhichOneof("parameter_choice"))
    return out


def test_a_guided_json_stream_validates_and_ends_at_the_grammar(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    stream = Stream(address)
    try:
        sampling = {"temperature": 0, "max_tokens": 150, "guided_json": PERSON, "logprobs": 2}
        got = stream.ask(CHAT.format("Describe a person as JSON."), sampling)
        assert all(e is None for _, e in got)
        text = "".join(text_of(r) for r, _ in got)
        jsonschema.validate(json.loads(text), PERSON)
        final = params(got[-1][0])
        assert final["finish_reason"] == "stop"
        entries = [e for r, _ in got for e in json.loads(params(r).get("logprobs", "[]"))]
        assert len(entries) == final["completion_tokens"]
        assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in entries)
        bad = stream.ask("Hello", {"max_tokens": 4, "guided_regex": "(("})
        assert bad[-1][1] is not None and "'guided_regex'" in str(bad[-1][1])
    finally:
        stream.close()


def test_n_choices_stream_with_their_index_and_bill_every_token(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    sampling = {"n": 3, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    prompt = "The capital of France is a city that many people visit because"
    stream = Stream(address)
    try:
        got = stream.ask(prompt, sampling)
    finally:
        stream.close()
    assert all(e is None for _, e in got)
    pieces = [(params(r), text_of(r)) for r, _ in got]
    finals = [p for p, _ in pieces if p["triton_final_response"]]
    assert len(finals) == 1 and pieces[-1][0]["triton_final_response"]
    assert finals[0]["completion_tokens"] == 3 * 12  # every choice's tokens
    texts = ["".join(t for p, t in pieces if p.get("index", 0) == i) for i in range(3)]
    assert texts[0] and texts[0] == texts[1] == texts[2]  # greedy
    ended = [p["index"] for p, _ in pieces if "finish_reason" in p and "index" in p]
    assert sorted(set(ended)) == [0, 1, 2]
    # unary: text_output [n], finish_reason in choice order
    client = triton.InferenceServerClient(address)
    result = client.infer(MODEL, inputs(prompt, False, sampling))
    out = result.as_numpy("text_output")
    assert out.shape == (3,) and [t.decode() for t in out] == texts
    assert params(result)["finish_reason"] == "length,length,length"
    assert params(result)["completion_tokens"] == 36


def ids_input(ids: np.ndarray) -> triton.InferInput:
    x = triton.InferInput(
        "input_ids", list(ids.shape), "INT32" if ids.dtype == np.int32 else "INT64"
    )
    x.set_data_from_numpy(ids)
    return x


def test_a_token_id_prompt_answers_as_its_text_and_bad_ids_are_named(served) -> None:  # type: ignore[no-untyped-def]
    address, _ = served
    client = triton.InferenceServerClient(address)
    sampling = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    text = "The capital of France is"
    expected = text_of(client.infer(MODEL, inputs(text, False, sampling)))
    rest = [t for t in inputs(text, False, sampling) if t.name() != "text_input"]
    ids = [504, 3575, 282, 4649, 314]  # SmolLM2's tokens of the text
    for dtype in (np.int64, np.int32):
        result = client.infer(MODEL, [ids_input(np.array(ids, dtype)), *rest])
        assert text_of(result) == expected
        assert params(result)["prompt_tokens"] == 5
    for bad, names in (([504, 99999], "token id 99999 at position 1"), ([], "non-empty")):
        with pytest.raises(triton.InferenceServerException) as e:
            client.infer(MODEL, [ids_input(np.array(bad, np.int64)), *rest])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "'input_ids'" in e.value.message() and names in e.value.message()


def test_a_client_filling_every_input_is_served_its_text_input(served) -> None:  # type: ignore[no-untyped-def]
    """perf_analyzer fills every input the metadata lists: text_input, the required prompt,
    is served, and the optional alternatives beside it (messages, input_ids, tools) are not
    read, however filled."""
    address, _ = served
    client = triton.InferenceServerClient(address)
    sampling = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    text = "The capital of France is"
    expected = text_of(client.infer(MODEL, inputs(text, False, sampling)))
    extra = []
    for name in ("messages", "tools"):
        x = triton.InferInput(name, [1], "BYTES")
        x.set_data_from_numpy(np.array([b"random bytes, not JSON"], dtype=object))
        extra.append(x)
    every = [*inputs(text, False, sampling), *extra, ids_input(np.array([99999], np.int64))]
    assert text_of(client.infer(MODEL, every)) == expected
