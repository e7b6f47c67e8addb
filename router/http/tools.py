"""Tool calls in llama.cpp's "generic" format: the answer is one JSON object, constrained by
a JSON schema, that either calls tools or replies.

llama.cpp's server uses this format for chat templates it has no native tool syntax for
(`common_chat_params_init_generic` in its common/chat.cpp): a system instruction asks for
JSON, the tools reach the model through its template (or a system prompt describing them,
worker/llm/chat.py), and the grammar makes the answer one of

    {"tool_call": {"name": ..., "arguments": {...}}}          (parallel_tool_calls false)
    {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}  (parallel_tool_calls true)
    {"response": "..."}                                      (tool_choice auto only)

so it always parses. tool_choice required (or a named function) leaves out `response`;
the arguments are constrained to each function's `parameters`. Call ids are the router's
(`call_<hex>`), not the model's. `Scan` reads a growing answer, so a stream sends the reply
text and each call's arguments as they are generated, as OpenAI streams them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with "
    "`response` reply to the user's request"
)
WHITESPACE = " \t\r\n"


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others, unless it
    says otherwise: what the answer may hold, as xgrammar's strict mode (vLLM's default) and
    llama.cpp's grammars read a schema. Left open, a small model invents keys until its
    max_tokens run out, each still valid."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in NESTED else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(s) for name, s in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


NESTED = {"items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties",
          "if", "then", "else", "contains"}  # fmt: skip


def schema(
    functions: list[dict], required: bool, parallel: bool, response: dict | None = None
) -> dict:
    """The answer's JSON schema for these functions (OpenAI's function objects)."""
    calls = []
    for f in functions:
        call: dict[str, Any] = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": f["name"]},
                "arguments": closed(f.get("parameters") or {"type": "object"}),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        calls.append(call)
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel:
        key, value = "tool_calls", {"type": "array", "items": one, "minItems": 1}
    else:
        key, value = "tool_call", one
    tool_call = {
        "type": "object",
        "properties": {key: value},
        "required": [key],
        "additionalProperties": False,
    }
    if required:
        return tool_call
    reply = {
        "type": "object",
        "properties": {"response": closed(response) if response else {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return {"anyOf": [tool_call, reply]}


def with_instruction(messages: list[dict]) -> list[dict]:
    """The messages with the JSON instruction added to the system message (or as one)."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{_text(first.get('content'))}\n\n{INSTRUCTION}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": INSTRUCTION}, *messages]


def _text(content: object) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- reading an answer, whole or growing -------------------------------------------------------


@dataclass
class Node:
    """A JSON value read from a prefix of an answer: its span and whether it is complete;
    an object's value is {key: Node}, an array's [Node], a string's the text decoded so
    far, a number's or literal's its raw text."""

    kind: str  # "object" | "array" | "string" | "scalar"
    start: int
    end: int
    done: bool
    value: Any


class _Partial(Exception):
    """The text ends inside a value."""


def scan(text: str) -> Node | None:
    """The JSON value at the start of `text`, as far as it goes; None when it is not JSON
    (ValueError) or nothing has come yet."""
    i = _skip(text, 0)
    if i == len(text):
        return None
    return _value(text, i)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _value(text: str, i: int) -> Node:
    c = text[i]
    if c == "{":
        return _container(text, i, "}")
    if c == "[":
        return _container(text, i, "]")
    if c == '"':
        return _string(text, i)
    j = i
    while j < len(text) and text[j] in "0123456789+-.eEtruefalsn":
        j += 1
    if j == i:
        raise ValueError(f"unexpected {c!r} at {i}")
    return Node("scalar", i, j, j < len(text), text[i:j])


def _container(text: str, start: int, closer: str) -> Node:
    """An object ("}") or array ("]") from its opening bracket at `start`: members (a key,
    ':' and a value) or items, as far as the text goes."""
    is_object = closer == "}"
    node = Node(
        "object" if is_object else "array", start, len(text), False, {} if is_object else []
    )
    i = _skip(text, start + 1)
    if i < len(text) and text[i] == closer:
        node.end, node.done = i + 1, True
        return node
    while i < len(text):
        if is_object:
            if text[i] != '"':
                raise ValueError(f"a key expected at {i}")
            key = _string(text, i)
            if not key.done:
                return node
            i = _skip(text, key.end)
            if i == len(text):
                return node
            if text[i] != ":":
                raise ValueError(f"':' expected at {i}")
            i = _skip(text, i + 1)
            if i == len(text):
                return node
        value = _value(text, i)
        if is_object:
            node.value[key.value] = value
        else:
            node.value.append(value)
        if not value.done:
            return node
        i = _skip(text, value.end)
        if i == len(text):
            return node
        if text[i] == closer:
            node.end, node.done = i + 1, True
            return node
        if text[i] != ",":
            raise ValueError(f"',' or '{closer}' expected at {i}")
        i = _skip(text, i + 1)
    return node


def _string(text: str, start: int) -> Node:
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return Node("string", start, i + 1, True, json.loads(text[start : i + 1]))
        i += 1
    return Node("string", start, len(text), False, _decoded_prefix(text[start + 1 :]))


def _decoded_prefix(raw: str) -> str:
    """What an unterminated JSON string decodes to so far: a trailing escape that may not
    be complete (or a high surrogate waiting for its pair) is held back."""
    while (cut := _open_escape(raw)) is not None:
        raw = raw[:cut]
    try:
        return str(json.loads(f'"{raw}"'))
    except ValueError:
        return ""


def _open_escape(raw: str) -> int | None:
    """Where a trailing escape that cannot be decoded yet starts, if there is one."""
    cut = raw.rfind("\\")
    if cut < 0:
        return None
    backslashes = cut + 1 - len(raw[: cut + 1].rstrip("\\"))
    escape = raw[cut:]
    if backslashes % 2 == 0 or len(escape) > 6:
        return None
    if len(escape) < 2 or (escape[1] == "u" and len(escape) < 6):
        return cut
    return cut if escape[1] == "u" and escape[2:4].lower() in _HIGH else None


_HIGH = {"d8", "d9", "da", "db"}


@dataclass
class Call:
    name: str
    arguments: str  # the arguments' JSON text as generated so far
    done: bool


@dataclass
class Answer:
    """An answer in the generic format, as far as it has come: its reply text, its calls,
    or undecided (None) while not even the first key is complete."""

    content: str | None
    calls: list[Call]
    decided: bool


def read(text: str, final: bool) -> Answer:
    """The answer `text` holds (all of it when `final`): text that is not this JSON is
    content as it is."""
    try:
        root = scan(text)
    except ValueError:
        return Answer(text, [], True)
    if root is None:
        return Answer("" if final else None, [], final)
    if root.kind != "object":
        return Answer(text, [], True) if final or root.kind != "scalar" else Answer(None, [], False)
    fields = root.value
    if "response" in fields:
        node = fields["response"]
        reply = node.value if node.kind == "string" else text[node.start : node.end]
        return Answer(reply, [], True)
    if "tool_call" in fields:
        return Answer(None, _calls(text, [fields["tool_call"]]), True)
    if "tool_calls" in fields and fields["tool_calls"].kind == "array":
        return Answer(None, _calls(text, fields["tool_calls"].value), True)
    if final:
        return Answer(text, [], True)
    return Answer(None, [], False)


def _calls(text: str, nodes: list[Node]) -> list[Call]:
    out = []
    for node in nodes:
        if node.kind != "object":
            continue
        name, arguments = node.value.get("name"), node.value.get("arguments")
        if name is None or name.kind != "string" or not name.done:
            break  # a call is announced once its name is complete
        raw = text[arguments.start : arguments.end] if arguments is not None else ""
        out.append(Call(name.value, raw, node.done))
    return out


@dataclass
class Deltas:
    """A growing answer turned into OpenAI's deltas: reply text and tool-call pieces (the
    first piece of a call has its id, type and name; the rest, argument text)."""

    sent_content: int = 0
    sent_calls: list[tuple[str, int]] = field(default_factory=list)  # (id, argument chars)
    text: str = ""

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        self.text += piece
        answer = read(self.text, final)
        content = ""
        if answer.content is not None:
            content = answer.content[self.sent_content :]
            self.sent_content = len(answer.content)
        calls = []
        for i, call in enumerate(answer.calls):
            if i == len(self.sent_calls):
                self.sent_calls.append((call_id(), 0))
                head = {"name": call.name, "arguments": ""}
                calls.append({"index": i, "id": self.sent_calls[i][0], "type": "function",
                              "function": head})  # fmt: skip
            cid, sent = self.sent_calls[i]
            if len(call.arguments) > sent:
                calls.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
                self.sent_calls[i] = (cid, len(call.arguments))
        return content, calls

    @property
    def called(self) -> bool:
        return bool(self.sent_calls)
