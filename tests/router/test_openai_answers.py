"""OpenAI's answers from worker responses (router/http/answers.py, responses.py) and the
generic tool format read whole and growing (router/http/tools.py). The worker responses are
real protobufs with the contract's parameters (common/llm_protocol.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common import bytes_codec
from common import llm_protocol as llm
from protos import grpc_service_pb2 as pb
from router.http import answers, openai, protocol, responses, tools

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris \\u00e9"}}}'


def reply(texts: list[str], final: bool = True, **params: object) -> pb.ModelInferResponse:
    r = pb.ModelInferResponse(model_name="m")
    r.outputs.add(name=llm.TEXT_OUTPUT, datatype="BYTES", shape=[len(texts)])
    r.raw_output_contents.append(bytes_codec.join(t.encode() for t in texts))
    r.parameters[llm.FINAL_RESPONSE].bool_param = final
    for key, value in params.items():
        if isinstance(value, int):
            r.parameters[key].int64_param = value
        else:
            r.parameters[key].string_param = str(value)
    return r


def generation(**fields: object) -> openai.Generation:
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return openai.chat(protocol.parse(protocol.ChatRequest, doc))


def events(data: bytes) -> list[dict]:
    out = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_the_schema_is_a_valid_json_schema_the_answers_meet() -> None:
    for required in (True, False):
        for parallel in (True, False):
            schema = tools.schema([WEATHER], required, parallel)
            jsonschema.Draft202012Validator.check_schema(schema)
            call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
            answer = {"tool_calls": [call]} if parallel else {"tool_call": call}
            jsonschema.validate(answer, schema)
            bad = {"name": "get_weather", "arguments": {}}
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(
                    {"tool_calls": [bad]} if parallel else {"tool_call": bad}, schema
                )
            if required:
                with pytest.raises(jsonschema.ValidationError):
                    jsonschema.validate({"response": "hi"}, schema)
            else:
                jsonschema.validate({"response": "hi"}, schema)


def test_closed_schemas_admit_no_keys_they_do_not_list() -> None:
    person = {
        "type": "object",
        "properties": {"pets": {"type": "array", "items": {"type": "object", "properties": {}}}},
        "$defs": {"x": {"anyOf": [{"type": "object", "properties": {"a": {}}}]}},
    }
    got = tools.closed(person)
    assert got["additionalProperties"] is False
    assert got["properties"]["pets"]["items"]["additionalProperties"] is False
    assert got["$defs"]["x"]["anyOf"][0]["additionalProperties"] is False
    assert tools.closed({"type": "object"}) == {"type": "object"}  # lists nothing: free
    assert tools.closed({"properties": {}, "additionalProperties": True})["additionalProperties"]
    jsonschema.validate({"pets": [{}]}, got)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"pets": [], "age": 3}, got)


def test_read_a_whole_answer() -> None:
    answer = tools.read(CALL, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [
        ("get_weather", {"city": "Paris é"})
    ]
    assert tools.read('{"response": "a \\"quote\\""}', True).content == 'a "quote"'
    assert tools.read("plain text", True).content == "plain text"  # not the format: as is
    two = '{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}]}'
    assert [(c.name, c.arguments) for c in tools.read(two, True).calls] == [
        ("a", "{}"),
        ("b", '{"x": [1]}'),
    ]


@pytest.mark.parametrize("text", [CALL, '{"response": "caf\\u00e9 \\ud83d\\ude00 \\n ok"}'])
def test_deltas_of_a_growing_answer_add_up_to_the_whole(text: str) -> None:
    deltas = tools.Deltas()
    content, arguments, names = "", "", []
    for i in range(len(text)):  # one character at a time: every cut an escape can have
        piece, calls = deltas.feed(text[i], final=i == len(text) - 1)
        content += piece
        for c in calls:
            if "id" in c:
                names.append(c["function"]["name"])
                assert c["id"].startswith("call_") and c["type"] == "function"
            arguments += c["function"]["arguments"]
    whole = tools.read(text, final=True)
    if whole.calls:
        assert names == ["get_weather"] and arguments == whole.calls[0].arguments
        assert json.loads(arguments) == {"city": "Paris é"} and content == ""
    else:
        assert content == whole.content == "café \U0001f600 \n ok" and not names


def test_a_unary_answer_with_n_choices_logprobs_and_usage() -> None:
    g = generation(n=2, logprobs=True, top_logprobs=1)
    entry = {"id": 1, "token": "a", "bytes": [97], "logprob": -0.5,
             "top_logprobs": [{"id": 1, "token": "a", "bytes": [97], "logprob": -0.5}]}  # fmt: skip
    r = reply(["a", "a"], finish_reason="stop,length", logprobs=json.dumps([[entry], [entry]]),
              prompt_tokens=5, completion_tokens=2)  # fmt: skip
    body = answers.answer(g, "id", r)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    lp = body["choices"][1]["logprobs"]["content"][0]
    assert (lp["token"], lp["logprob"], lp["bytes"], lp["top_logprobs"][0]["token"]) == (
        "a", -0.5, [97], "a",
    )  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_a_completion_has_the_legacy_logprobs() -> None:
    g = openai.completion(
        protocol.parse(protocol.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 1})
    )
    e = [{"token": t, "bytes": [], "logprob": -1.0, "top_logprobs": [{"token": t, "logprob": -1.0}]}
         for t in ("ab", "c")]  # fmt: skip
    body = answers.answer(g, "id", reply(["abc"], finish_reason="length", logprobs=json.dumps(e)))
    lp = body["choices"][0]["logprobs"]
    assert lp == {"tokens": ["ab", "c"], "token_logprobs": [-1.0, -1.0],
                  "top_logprobs": [{"ab": -1.0}, {"c": -1.0}], "text_offset": [0, 2]}  # fmt: skip


def test_a_tool_call_answer_and_its_stream() -> None:
    g = generation(tools=[{"type": "function", "function": WEATHER}], tool_choice="required",
                   parallel_tool_calls=False)  # fmt: skip
    body = answers.answer(g, "id", reply([CALL], finish_reason="stop"))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris é"}
    chunks = answers.Chunks(g, "id")
    out = b""
    for i in range(0, len(CALL), 7):
        last = i + 7 >= len(CALL)
        params = {"finish_reason": "stop"} if last else {}
        out += chunks.events(reply([CALL[i : i + 7]], final=last, **params))
    got = events(out)
    deltas = [d for e in got for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert got[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_stream_with_two_choices() -> None:
    g = generation(n=2, stream=True, stream_options={"include_usage": True})
    chunks = answers.Chunks(g, "id")
    out = chunks.events(reply(["A"], final=False, index=1))
    out += chunks.events(reply(["b"], final=False, index=0, finish_reason="length"))
    out += chunks.events(reply(["B"], final=True, index=1, finish_reason="stop",
                               prompt_tokens=3, completion_tokens=4))  # fmt: skip
    got = events(out)
    text = {0: "", 1: ""}
    finish = {}
    for e in got[:-1]:
        (c,) = e["choices"]
        text[c["index"]] += c["delta"].get("content", "")
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert text == {0: "b", 1: "AB"} and finish == {0: "length", 1: "stop"}
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 4
    assert out.endswith(b"data: [DONE]\n\n")


def test_a_response_whole_and_streamed() -> None:
    req = protocol.parse(
        responses.ResponsesRequest, {"model": "m", "input": "hi", "instructions": "be brief"}
    )
    g = responses.generation(req)
    assert g.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    body = responses.Response(g).whole(reply(["Hello"], finish_reason="stop", prompt_tokens=2,
                                             completion_tokens=1))  # fmt: skip
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == "Hello"
    assert body["usage"]["input_tokens"] == 2 and body["usage"]["output_tokens"] == 1
    stream = responses.Events(g)
    out = stream.start() + stream.events(reply(["Hel"], final=False))
    out += stream.events(reply(["lo"], final=True, finish_reason="length"))
    kinds = [
        json.loads(line[6:])["type"] for line in out.split(b"\n") if line.startswith(b"data: ")
    ]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.output_text.delta") == 2 and kinds[-1] == "response.incomplete"


def test_a_response_that_calls_a_function_whole_and_streamed() -> None:
    doc = {"model": "m", "input": "weather?", "tool_choice": "required",
           "tools": [{"type": "function", **WEATHER}], "parallel_tool_calls": False}  # fmt: skip
    g = responses.generation(protocol.parse(responses.ResponsesRequest, doc))
    body = responses.Response(g).whole(reply([CALL], finish_reason="stop"))
    (item,) = body["output"]
    assert (item["type"], item["name"], item["status"]) == (
        "function_call",
        "get_weather",
        "completed",
    )
    assert (
        item["call_id"].startswith("call_") and json.loads(item["arguments"])["city"] == "Paris é"
    )
    stream = responses.Events(g)
    out = stream.start()
    for i in range(0, len(CALL), 5):
        out += stream.events(
            reply([CALL[i : i + 5]], final=i + 5 >= len(CALL), finish_reason="stop")
        )
    got = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]
    deltas = "".join(
        e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta"
    )
    done = next(e for e in got if e["type"] == "response.function_call_arguments.done")
    assert deltas == done["arguments"] == item["arguments"]
    assert got[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in got] == list(range(len(got)))


def test_a_response_input_with_calls_and_their_outputs_becomes_a_chat() -> None:
    doc = {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3C"},
    ]}  # fmt: skip
    g = responses.generation(protocol.parse(responses.ResponsesRequest, doc))
    assert g.messages is not None
    user, called, answer = g.messages
    assert user == {"role": "user", "content": "weather?"}
    assert [c["id"] for c in called["tool_calls"]] == ["call_1", "call_2"]
    assert answer == {"role": "tool", "tool_call_id": "call_1", "content": "-3C"}
