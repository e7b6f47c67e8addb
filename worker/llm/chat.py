"""A model's own chat template, rendered where its tokenizer lives: messages in, prompt out.

The template is the model's: the `chat_template` of the tokenizer config in the model folder
(`tokenizer_config.json`, Hugging Face's file, written at build time from the GGUF's
`tokenizer.chat_template`; see quantize/llm.py). It renders as Hugging Face's
`apply_chat_template` renders it: jinja2's immutable sandbox with `trim_blocks` and
`lstrip_blocks`, the `raise_exception`, `strftime_now` and `namespace` globals, the
non-escaping `tojson` filter, the config's special tokens (bos_token, eos_token, ...) as
variables, and `add_generation_prompt` so the text ends where the assistant's answer starts.

A message is `{"role": str, "content": str}`, or content as OpenAI's list of text parts
(`[{"type": "text", "text": ...}]`, joined); an assistant's may carry `tool_calls`, a tool
message its `tool_call_id`. Anything else is INVALID_ARGUMENT naming the message and the
field; so is a template that refuses the conversation (raise_exception).

Tools (the `tools` input, OpenAI's tool objects) reach the template as its `tools`
variable. What a template cannot show is converted first, as llama.cpp's minja does
(`chat_template` polyfills): the template's abilities are found once by rendering probe
conversations; without tools support the tools are described in the system message, without
tool calls an assistant's calls become its content as JSON ({"tool_calls": [...]}), and
without tool responses a tool message becomes a user message holding {"tool_response": ...}.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import InvalidArgument
from worker.config import ConfigError

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_MESSAGES = 1024
MAX_TOOLS = 128


class ChatTemplate:
    def __init__(self, template: str, variables: dict[str, str], model: str) -> None:
        self.model = model
        self.variables = variables
        try:
            self.template = _environment().from_string(template)
        except jinja2.TemplateError as e:
            raise ConfigError(f"model {model!r}: its chat template does not compile: {e}") from e
        self.abilities = Abilities.of(self._probe)

    def _probe(self, messages: list[dict], tools: list | None = None) -> str:
        """A raw render for finding the template's abilities ("" when it refuses)."""
        try:
            return self.template.render(
                messages=messages, tools=tools, add_generation_prompt=False, **self.variables
            )
        except Exception:  # any template error is "cannot", as minja's try_raw_render
            return ""

    @classmethod
    def from_folder(cls, folder: Path, model: str) -> ChatTemplate | None:
        """The folder's template, or None when the model has none (chat is then refused)."""
        path = folder / CONFIG_FILE
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model {model!r}: {path} is not a JSON object: {e}") from e
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # several named templates: the default one
            template = next(
                (t.get("template") for t in template if t.get("name") == "default"), None
            )
        if not isinstance(template, str) or not template:
            return None
        variables = {k: _token(config.get(k)) for k in SPECIAL_TOKENS if config.get(k)}
        return cls(template, variables, model)

    def render(self, messages: object, tools: object = None) -> str:
        """The prompt for `messages` (a JSON value: a list of messages) and `tools` (None
        or a list of OpenAI tool objects), ending with the generation prompt."""
        checked = check_messages(messages)
        if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):
            raise InvalidArgument(f"tools: a list of at most {MAX_TOOLS} tool objects expected")
        checked = self.abilities.convert(checked, tools or None)
        try:
            return self.template.render(
                messages=checked,
                tools=tools if tools and self.abilities.tools else None,
                add_generation_prompt=True,
                **self.variables,
            )
        except jinja2.TemplateError as e:
            raise InvalidArgument(
                f"model {self.model!r}'s chat template refused the messages: {e}"
            ) from None


def check_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: a non-empty list of {role, content} objects expected")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages: at most {MAX_MESSAGES}, got {len(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}]: an object expected, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidArgument(
                f"messages[{i}].role: one of {list(ROLES)} expected, got {role!r}"[:300]
            )
        message: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls")
        if calls is not None:
            message["tool_calls"] = _tool_calls(calls, i)
        content = m.get("content")
        message["content"] = None if content is None and calls else _content(content, i)
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _tool_calls(calls: object, i: int) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidArgument(f"{where}: a list of tool calls expected")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise InvalidArgument(f"{where}[{j}].function.name: a string expected")
    return calls


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidArgument(
                    f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': "
                    "...}}) are supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidArgument(f"messages[{i}].content[{j}].text: a string expected")
            texts.append(text)
        return "".join(texts)
    raise InvalidArgument(
        f"messages[{i}].content: a string or a list of text parts expected, "
        f"got {type(content).__name__}"
    )


PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "A tool.",
        "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
    },
}


@dataclass(frozen=True)
class Abilities:
    """What a template shows of tools, found by rendering probes (minja's caps)."""

    tools: bool
    tool_calls: bool
    tool_responses: bool

    @classmethod
    def of(cls, render: Callable[..., str]) -> Abilities:
        user = {"role": "user", "content": "Hey"}
        args = json.dumps({"argument_needle": "x"})
        call = {"id": "call_1", "type": "function",
                "function": {"name": "probe_tool", "arguments": args}}  # fmt: skip
        called = {"role": "assistant", "content": None, "tool_calls": [call]}
        tool_calls = "argument_needle" in render([user, called])
        answer = {"role": "tool", "tool_call_id": "call_1", "content": "Some response!"}
        return cls(
            tools="probe_tool" in render([user], [PROBE_TOOL]),
            tool_calls=tool_calls,
            tool_responses=tool_calls and "Some response!" in render([user, called, answer]),
        )

    def convert(self, messages: list[dict], tools: list | None) -> list[dict]:
        """The messages with what the template cannot show made text."""
        out = []
        for m in messages:
            m = dict(m)
            if "tool_calls" in m and not self.tool_calls:
                shown: dict[str, Any] = {
                    "tool_calls": [_shown_call(c) for c in m.pop("tool_calls")]
                }
                if m.get("content"):
                    shown["content"] = m["content"]
                m["content"] = json.dumps(shown, indent=2)
            if m["role"] == "tool" and not self.tool_responses:
                response = {"tool": m.pop("name", None), "content": m["content"],
                            "tool_call_id": m.pop("tool_call_id", None)}  # fmt: skip
                shown = {k: v for k, v in response.items() if v is not None}
                m = {"role": "user", "content": json.dumps({"tool_response": shown}, indent=2)}
            out.append(m)
        if tools and not self.tools:
            text = "You can call any of the following tools to satisfy the user's requests: "
            out = _with_system(out, text + json.dumps(tools, indent=2))
        return out


def _shown_call(call: dict) -> dict:
    f = call["function"]
    arguments = f.get("arguments")
    with contextlib.suppress(ValueError):  # shown as the object it holds, as minja does
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    shown = {"name": f["name"], "arguments": arguments}
    if "id" in call:
        shown["id"] = call["id"]
    return shown


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _token(value: object) -> str:
    """A special token as the config writes it: a string or an AddedToken-like object."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = jinja2.utils.Namespace
    return env
