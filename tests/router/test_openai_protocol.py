"""The OpenAI request models (router/http/protocol.py): what they take, what they turn into
for the worker (router/http/openai.py), and a 400 naming the field for each bad input."""

from __future__ import annotations

import json

import pytest

from common import llm_protocol as llm
from protos import grpc_service_pb2 as pb
from router.http import openai, protocol, responses
from router.http.errors import HttpError

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def chat(**fields: object) -> openai.Generation:
    return openai.chat(
        protocol.parse(protocol.ChatRequest, {"model": "m", "messages": HI, **fields})
    )


def refused(model: type, doc: dict) -> HttpError:
    with pytest.raises(HttpError) as e:
        protocol.parse(model, doc)
    assert e.value.status == 400
    return e.value


BAD_CHATS = [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"temperature": "1"}, "temperature"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tool_choice": "maybe", "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": {"type": "objectx"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"functions": []}, "functions"),
    ({"messagez": []}, "messagez"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), BAD_CHATS)
def test_a_bad_chat_is_a_400_naming_the_field(fields: dict, param: str) -> None:
    error = refused(protocol.ChatRequest, {"model": "m", "messages": HI, **fields})
    assert error.param == param, error.message
    assert error.message.startswith(param + ":")
    body = json.loads(error.openai())["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error"


BAD_COMPLETIONS = [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt[0]"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS)
def test_a_bad_completion_is_a_400_naming_the_field(fields: dict, param: str) -> None:
    assert refused(protocol.CompletionRequest, {"model": "m", **fields}).param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "hi", "store": True}, "store"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "weird"}]}, "input[0]"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
         "text.format.schema"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_a_bad_response_request_is_a_400_naming_the_field(fields: dict, param: str) -> None:
    assert refused(responses.ResponsesRequest, {"model": "m", **fields}).param == param


def test_embeddings_take_strings_or_token_ids() -> None:
    e = protocol.parse(protocol.EmbeddingRequest, {"model": "m", "input": [[1, 2, 3], [4]]})
    request = pb.ModelInferRequest.FromString(openai.embedding_request(e, "x"))
    assert [(t.name, list(t.shape)) for t in request.inputs] == [
        ("input_ids", [2, 3]),
        ("attention_mask", [2, 3]),
    ]
    assert request.raw_input_contents[1] == b"".join(
        v.to_bytes(8, "little") for v in (1, 1, 1, 1, 0, 0)
    )
    assert refused(protocol.EmbeddingRequest, {"model": "m", "input": [[]]}).param == "input"
    assert refused(protocol.EmbeddingRequest, {"model": "m", "input": "x", "dimensions": 3}).param


def _inputs(g: openai.Generation) -> dict[str, bytes]:
    request = pb.ModelInferRequest.FromString(openai.worker_request(g, "r"))
    return {t.name: raw for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)}


def _sampling(g: openai.Generation) -> dict:
    return json.loads(_inputs(g)[llm.SAMPLING_PARAMETERS][4:])


def test_response_format_becomes_the_guided_keys() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert _sampling(chat(response_format=fmt))[llm.GUIDED_JSON] == {
        **schema, "additionalProperties": False,
    }  # fmt: skip
    assert _sampling(chat(response_format={"type": "json_object"}))[llm.GUIDED_JSON_OBJECT]
    assert not set(llm.GUIDED_KEYS) & set(_sampling(chat(response_format={"type": "text"})))
    assert _sampling(chat(guided_choice=["yes", "no"]))["guided_choice"] == ["yes", "no"]
    assert _sampling(chat(guided_json=json.dumps(schema)))["guided_json"] == schema


def test_n_logprobs_and_sampling_keys() -> None:
    s = _sampling(chat(n=3, logprobs=True, top_logprobs=2, max_completion_tokens=9, stop="x"))
    assert (s["n"], s["logprobs"], s["max_tokens"], s["stop"]) == (3, 2, 9, ["x"])
    assert _sampling(chat(logprobs=True))["logprobs"] == 0
    assert "logprobs" not in _sampling(chat())


def test_token_id_prompts_go_as_input_ids() -> None:
    g = openai.completion(
        protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": [[5, 6, 7]]})
    )
    request = pb.ModelInferRequest.FromString(openai.worker_request(g, "r"))
    ids = next(t for t in request.inputs if t.name == llm.INPUT_IDS)
    assert (ids.datatype, list(ids.shape)) == ("INT64", [3])
    assert llm.TEXT_INPUT not in _inputs(g)


def test_tools_send_the_tools_input_the_instruction_and_the_schema() -> None:
    g = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    inputs = _inputs(g)
    assert json.loads(inputs[llm.TOOLS][4:]) == [WEATHER]
    messages = json.loads(inputs[llm.MESSAGES][4:])
    assert messages[0]["role"] == "system" and "tool_call" in messages[0]["content"]
    schema = _sampling(g)[llm.GUIDED_JSON]
    assert schema["required"] == ["tool_call"]
    call = schema["properties"]["tool_call"]
    closed = {**WEATHER["function"]["parameters"], "additionalProperties": False}
    assert call["properties"]["arguments"] == closed
    # auto: a reply is allowed too; none: no tools at all
    assert "anyOf" in _sampling(chat(tools=[WEATHER]))[llm.GUIDED_JSON]
    none = chat(tools=[WEATHER], tool_choice="none")
    assert llm.TOOLS not in _inputs(none) and not none.tool_format
