"""OpenAI's Responses API (`POST /v1/responses`), its stateless subset, over the chat path.

A request becomes a chat: `instructions` the system message, `input` a string (one user
message) or a list of items: messages, `function_call` items (an assistant's tool calls)
and `function_call_output` items (tool messages). `text.format` is the chat's
response_format, the flat function `tools` the chat's tools (tools.py's format). Nothing is
stored: `store: true` and `previous_response_id` are refused by name (protocol.py). The
answer is a `response` object whose `output` holds one message (`output_text`) or the
function calls; streamed, the events OpenAI sends (`response.created`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each with its sequence number.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from common import llm_protocol as llm
from protos import grpc_service_pb2 as pb
from router.http import answers, tensors, tools
from router.http.openai import Generation, tool_setup
from router.http.protocol import (
    NAME,
    FunctionDef,
    JsonObjectFormat,
    Strict,
    TextFormat,
    bad,
    check_choice,
    check_schema,
    check_tools,
    one_of,
)

# -- the request -------------------------------------------------


class InputText(Strict):
    type: Literal["input_text", "output_text"] = "input_text"
    text: str
    annotations: list | None = None


class InputMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(Strict):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


if TYPE_CHECKING:
    InputItem = InputMessage | FunctionCallItem | FunctionCallOutput
else:  # the same unions, picked by `type` (mypy cannot read one_of's result as a type)
    InputItem = one_of(InputMessage, FunctionCallItem, FunctionCallOutput, default="message")


class ResponseTool(Strict):
    type: Literal["function"] = "function"
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoice(Strict):
    type: Literal["function"] = "function"
    name: str


class FlatJsonSchema(Strict):
    type: Literal["json_schema"] = "json_schema"
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


if TYPE_CHECKING:
    Format = TextFormat | JsonObjectFormat | FlatJsonSchema
else:
    Format = one_of(TextFormat, JsonObjectFormat, FlatJsonSchema)


class TextConfig(Strict):
    format: Format | None = None


class ResponsesRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[ResponseTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    @model_validator(mode="after")
    def _responses(self) -> ResponsesRequest:
        if self.store:
            raise bad("store", "responses are not stored here: send store: false (or omit it)")
        tools = [FunctionDef(name=t.name, parameters=t.parameters) for t in self.tools or []]
        check_tools(tools, "tools[{}]")
        check_choice(self.tool_choice, [t.name for t in tools], "tool_choice")
        fmt = self.text.format if self.text else None
        if isinstance(fmt, FlatJsonSchema):
            check_schema(fmt.schema_, "text.format")
        return self


# -- the answer ----------------------------------------------------------------------------


def generation(req: ResponsesRequest) -> Generation:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + (
        [{"role": "user", "content": req.input}] if isinstance(req.input, str) else _items(req)
    )
    sampling: dict[str, Any] = {"max_tokens": req.max_output_tokens or 256}
    for key in ("temperature", "top_p"):
        if getattr(req, key) is not None:
            sampling[key] = getattr(req, key)
    fmt = req.text.format if req.text else None
    response = None
    if isinstance(fmt, FlatJsonSchema):
        response = fmt.schema_
    elif isinstance(fmt, JsonObjectFormat):
        response = {"type": "object"}
    functions = [t.model_dump(exclude_none=True, exclude={"type"}) for t in req.tools or []]
    choice = req.tool_choice if isinstance(req.tool_choice, str) else None
    named = req.tool_choice.name if isinstance(req.tool_choice, ResponseToolChoice) else None
    messages, chat_tools, answer = tool_setup(
        functions, choice, named, req.parallel_tool_calls, messages, response
    )
    if answer is not None:
        sampling[llm.GUIDED_JSON] = answer
    elif isinstance(fmt, FlatJsonSchema):
        sampling[llm.GUIDED_JSON] = tools.closed(response)
    elif isinstance(fmt, JsonObjectFormat):
        sampling[llm.GUIDED_JSON_OBJECT] = True
    echo = req.model_dump(exclude_none=True, by_alias=True, exclude={"input", "stream", "user"})
    return Generation(
        req.model, True, req.stream, sampling, messages=messages, tools=chat_tools,
        tool_format=answer is not None, extra=echo,
    )  # fmt: skip


def _items(req: ResponsesRequest) -> list[dict]:
    out: list[dict] = []
    assert not isinstance(req.input, str)
    for item in req.input:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            content = item.content
            if not isinstance(content, str):
                content = "".join(part.text for part in content)
            out.append({"role": item.role, "content": content})
    return out


def _usage(reply: pb.ModelInferResponse) -> dict | None:
    used = answers.usage(reply)
    if used is None:
        return None
    cached = (used.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": used["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": used["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": used["total_tokens"],
    }


def _message_item(text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    content = [part] if text or status == "completed" else []
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status,
            "role": "assistant", "content": content}  # fmt: skip


def _call_item(cid: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": "fc_" + cid.removeprefix("call_"), "call_id": cid,
            "name": name, "arguments": arguments, "status": status}  # fmt: skip


class Response:
    """One response object, whole or built up by a stream's pieces."""

    def __init__(self, g: Generation) -> None:
        self.g = g
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.incomplete = False

    def body(self, status: str) -> dict:
        extra = {k: v for k, v in self.g.extra.items() if k not in ("model",)}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.g.model, "output": self.output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.incomplete else None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": True,
            "temperature": None, "top_p": None, "tool_choice": "auto", "tools": [],
            "previous_response_id": None, "store": False, "usage": self.usage, **extra,
        }  # fmt: skip

    def whole(self, reply: pb.ModelInferResponse) -> dict:
        text = (tensors.output_texts(reply, llm.TEXT_OUTPUT) or [""])[0]
        self.incomplete = answers.finish_reasons(reply)[0] == "length"
        message, called = answers.message(self.g, text)
        if called:
            for c in message["tool_calls"]:
                f = c["function"]
                self.output.append(_call_item(c["id"], f["name"], f["arguments"], "completed"))
        else:
            self.output.append(_message_item(message["content"] or "", "completed"))
        self.usage = _usage(reply)
        return self.body("incomplete" if self.incomplete else "completed")


class Events:
    """The server-sent events of one streamed response."""

    def __init__(self, g: Generation) -> None:
        self.response = Response(g)
        self.sequence = 0
        self.deltas = tools.Deltas() if g.tool_format else None
        self.text: str | None = None  # the message's text so far, once its item is open
        self.calls: list[dict] = []  # the function_call items, as they grow

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

    def start(self) -> bytes:
        body = self.response.body("in_progress")
        return self._event("response.created", response=body) + self._event(
            "response.in_progress", response=body
        )

    def _text(self, delta: str) -> bytes:
        out = b""
        if self.text is None:
            self.text = ""
            item = _message_item("", "in_progress")
            self.response.output.append(item)
            out += self._event("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event("response.content_part.added", item_id=item["id"],
                               output_index=0, content_index=0, part=part)  # fmt: skip
        self.text += delta
        item_id = self.response.output[0]["id"]
        return out + self._event("response.output_text.delta", item_id=item_id, output_index=0,
                                 content_index=0, delta=delta, logprobs=[])  # fmt: skip

    def _call(self, piece: dict) -> bytes:
        i = piece["index"]
        if "id" in piece:
            item = _call_item(piece["id"], piece["function"]["name"], "", "in_progress")
            self.calls.append(item)
            self.response.output.append(item)
            return self._event("response.output_item.added", output_index=i, item=item)
        item = self.calls[i]
        delta = piece["function"]["arguments"]
        item["arguments"] += delta
        return self._event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=i, delta=delta)  # fmt: skip

    def events(self, reply: pb.ModelInferResponse) -> bytes:
        text = tensors.output_text(reply, llm.TEXT_OUTPUT)
        final = llm.is_final(reply.parameters)
        calls: list = []
        if self.deltas is not None:
            text, calls = self.deltas.feed(text, final)
        out = self._text(text) if text else b""
        for piece in calls:
            out += self._call(piece)
        if final:
            out += self._finish(reply)
        return out

    def _finish(self, reply: pb.ModelInferResponse) -> bytes:
        r = self.response
        r.incomplete = answers.finish_reasons(reply)[0] == "length"
        r.usage = _usage(reply)
        out = b""
        if self.text is None and not self.calls:
            out += self._text("")
        status = "incomplete" if r.incomplete else "completed"
        for i, item in enumerate(r.output):
            item["status"] = status
            if item["type"] == "message":
                part: dict = {"type": "output_text", "text": self.text}
                part.update(annotations=[], logprobs=[])
                item["content"] = [part]
                ids = {"item_id": item["id"], "output_index": i, "content_index": 0}
                out += self._event("response.output_text.done", text=self.text, logprobs=[], **ids)
                out += self._event("response.content_part.done", part=part, **ids)
            else:
                out += self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=i, name=item["name"],
                                   arguments=item["arguments"])  # fmt: skip
            out += self._event("response.output_item.done", output_index=i, item=item)
        kind = "response.incomplete" if r.incomplete else "response.completed"
        return out + self._event(kind, response=r.body(status))
