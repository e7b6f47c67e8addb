"""What applications send over OpenAI's API, against a real mesh (redis, a worker serving
SmolLM2 and MiniLM, the router with API keys, the ledger) with the official openai SDK:
structured output, tool calls (required, named, auto, none; streamed too), logprobs, n > 1,
echo, token-id prompts and embeddings, /v1/responses, a 400 naming the field for each bad
input, and a bill whose tokens are the answers' usage."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from devmesh.testing import Mesh
from ledger.store import Store
from tests.integration.test_http import _post, http_mesh, key_for, sdk

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, str, Store, Path]]:
    aliases = "gpt-4o=smollm2, text-embedding-3-small=minilm"
    with http_mesh(tmp_path_factory.mktemp("openai"), "--http-model-aliases", aliases) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    mesh, base, _, _ = served
    return sdk(base, key_for(mesh, "apps", models=("smollm2", "minilm", "mlp")))


def test_json_schema_and_json_object(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = [{"role": "user", "content": "Invent a person. Answer in JSON."}]
    chat = client.chat.completions.create(
        model="smollm2", messages=ask, response_format=fmt, n=4, temperature=1.0, max_tokens=60,
        seed=1,
    )  # fmt: skip
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    ask = [{"role": "user", "content": "A JSON object with a name and an age, please."}]
    stream = client.chat.completions.create(
        model="smollm2", messages=ask, response_format={"type": "json_object"}, stream=True,
        max_tokens=200, temperature=0,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def _arguments_valid(call: object, tool: dict) -> None:
    assert call.function.name == tool["function"]["name"]  # type: ignore[attr-defined]
    arguments = json.loads(call.function.arguments)  # type: ignore[attr-defined]
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_or_named_tool_is_called_with_valid_arguments(
    client: openai.OpenAI, choice: object
) -> None:
    chat = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, TIME] if choice == "required" else [WEATHER],
        tool_choice=choice, max_tokens=80, temperature=0,  # type: ignore[arg-type]
    )  # fmt: skip
    (answer,) = chat.choices
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    calls = answer.message.tool_calls or []
    assert calls
    for call in calls:
        _arguments_valid(call, WEATHER if call.function.name == "get_weather" else TIME)
    # Streamed: the deltas add up to the same kind of call.
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80, temperature=0, stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_auto_and_none(client: openai.OpenAI) -> None:
    auto = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0
    )
    message = auto.choices[0].message
    if message.tool_calls:  # the model's choice: a valid call, or a plain reply
        assert auto.choices[0].finish_reason == "tool_calls"
        _arguments_valid(message.tool_calls[0], WEATHER)
    else:
        assert message.content and not message.content.lstrip().startswith('{"response"')
    none = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    # A conversation holding a call and its answer renders (SmolLM2 has no tool syntax).
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
               "type": "function", "function": {"name": "get_weather",
               "arguments": '{"city": "Paris", "celsius": true}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]  # fmt: skip
    after = client.chat.completions.create(
        model="smollm2",
        messages=history,
        tools=[WEATHER],
        max_tokens=40,
        temperature=0,  # type: ignore[arg-type]
    )
    assert after.choices[0].message.content or after.choices[0].message.tool_calls


def test_logprobs_chat_and_completions_streamed_and_not(client: openai.OpenAI) -> None:
    hi = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(
        model="smollm2", messages=hi, logprobs=True, top_logprobs=3, max_tokens=5, temperature=0
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert (
        len(content) == 5 and "".join(t.token for t in content) == chat.choices[0].message.content
    )
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.bytes is not None
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.token == t.top_logprobs[0].token  # greedy: the best one was taken
    stream = client.chat.completions.create(
        model="smollm2", messages=hi, logprobs=True, max_tokens=5, temperature=0, stream=True
    )
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [t.token for t in tokens] == [t.token for t in content]
    done = client.completions.create(
        model="smollm2", prompt="The capital of France is", logprobs=2, max_tokens=4, temperature=0
    )
    lp = done.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 4 and len(lp.token_logprobs or []) == 4
    assert all(len(d) == 2 for d in lp.top_logprobs or []) and (lp.text_offset or [])[0] == 0
    streamed = client.completions.create(
        model="smollm2", prompt="The capital of France is", logprobs=2, max_tokens=4,
        temperature=0, stream=True,
    )  # fmt: skip
    got = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    assert got == lp.tokens


def test_n_choices_echo_and_token_id_prompts(client: openai.OpenAI, served) -> None:  # type: ignore[no-untyped-def]
    two = client.chat.completions.create(
        model="smollm2", messages=ASK, n=2, max_tokens=8, temperature=1.0, seed=3
    )
    assert [c.index for c in two.choices] == [0, 1]
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, n=2, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts.values()) and chunks[-1].usage is not None
    echoed = client.completions.create(
        model="smollm2", prompt="Once upon a time", echo=True, max_tokens=5, temperature=0
    )
    assert echoed.choices[0].text.startswith("Once upon a time")
    _, _, _, repo = served
    tokenizer = Tokenizer.from_file(str(next((repo / "smollm2").rglob("tokenizer.json"))))
    ids = tokenizer.encode("The capital of France is").ids
    by_ids = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    # Embeddings of token ids: the vectors of the same text.
    minilm = Tokenizer.from_file(str(next((repo / "minilm").rglob("tokenizer.json"))))
    texts_in = ["a robot", "the capital of France"]
    rows = [minilm.encode(t).ids for t in texts_in]
    by_rows = client.embeddings.create(model="minilm", input=rows, encoding_format="float")
    by_strings = client.embeddings.create(model="minilm", input=texts_in, encoding_format="float")
    np.testing.assert_allclose(
        [d.embedding for d in by_rows.data], [d.embedding for d in by_strings.data], atol=1e-5
    )


def test_responses_basic_and_streamed(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="smollm2", input="Name a sea.", instructions="Answer briefly.",
        max_output_tokens=16, temperature=0,
    )  # fmt: skip
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage is not None and r.usage.output_tokens <= 16
    events = list(client.responses.create(
        model="smollm2", input="Name a sea.", instructions="Answer briefly.",
        max_output_tokens=16, temperature=0, stream=True,
    ))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    called = client.responses.create(
        model="smollm2", input=ASK, max_output_tokens=80, tool_choice="required",  # type: ignore[arg-type]
        tools=[{"type": "function", **WEATHER["function"]}],  # type: ignore[list-item]
    )  # fmt: skip
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


BAD = [
    ({"n": 0}, "n"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"1": 1}}, "logit_bias"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=2, extra_body=extra
        )
    assert bad.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as stored:
        client.responses.create(model="smollm2", input="hi", store=True)
    assert stored.value.body["param"] == "store"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as ids:  # a model that takes no token ids
        client.embeddings.create(model="mlp", input=[[1, 2, 3]])
    assert ids.value.body["param"] == "input"  # type: ignore[index]


def test_model_names_aliases_defaults_and_routes_without_v1(served) -> None:  # type: ignore[no-untyped-def]
    """An aliased name is served as its model; an omitted model is the one served model of
    the endpoint's kind (the LLM for chat, the embedder for embeddings); llama-server's
    routes without /v1 answer the same; with no model of a kind, 400 naming `model`."""
    mesh, base, _, _ = served
    key = key_for(mesh, "names", models=("smollm2", "minilm", "mlp"))
    chat = {"messages": ASK, "max_tokens": 2}
    for path in ("/v1/chat/completions", "/chat/completions"):
        for body in (chat, {**chat, "model": "gpt-4o"}):
            status, reply = _post(base, path, body, key)
            assert status == 200 and reply["model"] == "smollm2", reply
    for path in ("/v1/embeddings", "/embeddings"):
        for body in ({"input": "hi"}, {"input": "hi", "model": "text-embedding-3-small"}):
            status, reply = _post(base, path, body, key)
            assert status == 200 and reply["model"] == "minilm", reply
            assert reply["usage"]["prompt_tokens"] == 3, reply  # [CLS] hi [SEP]
    status, reply = _post(base, "/completions", {"prompt": "Hi", "max_tokens": 2}, key)
    assert status == 200 and reply["model"] == "smollm2", reply
    status, reply = _post(base, "/v1/chat/completions", {**chat, "model": "gpt-5"}, key)
    assert status in (403, 404) and "gpt-5" in reply["error"]["message"], reply
    status, reply = _post(base, "/chat/completions", chat, key_for(mesh, "mlp", models=("mlp",)))
    assert status == 400 and reply["error"]["param"] == "model", reply
    with urllib.request.urlopen(base + "/health", timeout=10) as health:
        assert health.status == 200


def test_the_bill_counts_every_choice_s_tokens(served) -> None:  # type: ignore[no-untyped-def]
    mesh, base, store, _ = served
    client = sdk(base, key_for(mesh, "billed", models=("smollm2",)))
    used = []
    for stream in (False, True):
        kwargs: dict = {"stream_options": {"include_usage": True}} if stream else {}
        answer = client.chat.completions.create(
            model="smollm2", messages=ASK, n=3, max_tokens=7, stream=stream, **kwargs
        )
        usage = list(answer)[-1].usage if stream else answer.usage  # type: ignore[union-attr,arg-type]
        assert usage is not None and usage.completion_tokens > 7  # more than one choice's
        used.append((usage.prompt_tokens, usage.completion_tokens))
    want = tuple(sum(u[i] for u in used) for i in (0, 1))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        row = store.tenant_usage().get(("billed", "smollm2"), {})
        if (row.get("prompt_tokens"), row.get("completion_tokens")) == want:
            break
        time.sleep(0.2)
    row = store.tenant_usage()[("billed", "smollm2")]
    assert (row["prompt_tokens"], row["completion_tokens"]) == want
