"""A model's own chat template, rendered where its tokenizer lives: messages in, prompt out.

The template is the model's: the `chat_template` of the tokenizer config in the model folder
(`tokenizer_config.json`, Hugging Face's file, written at build time from the GGUF's
`tokenizer.chat_template`; see quantize/llm.py). It renders as Hugging Face's
`apply_chat_template` renders it: jinja2's immutable sandbox with `trim_blocks` and
`lstrip_blocks`, the `raise_exception`, `strftime_now` and `namespace` globals, the
non-escaping `tojson` filter, the config's special tokens (bos_token, eos_token, ...) as
variables, and `add_generation_prompt` so the text ends where the assistant's answer starts.

A message is `{"role": str, "content": str}`, or content as OpenAI's list of text parts
(`[{"type": "text", "text": ...}]`, joined). Anything else is INVALID_ARGUMENT naming the
message and the field; so is a template that refuses the conversation (raise_exception).
"""

from __future__ import annotations

import json
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


class ChatTemplate:
    def __init__(self, template: str, variables: dict[str, str], model: str) -> None:
        self.model = model
        self.variables = variables
        try:
            self.template = _environment().from_string(template)
        except jinja2.TemplateError as e:
            raise ConfigError(f"model {model!r}: its chat template does not compile: {e}") from e

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

    def render(self, messages: object) -> str:
        """The prompt for `messages` (a JSON value: a list of messages), ending with the
        generation prompt."""
        checked = check_messages(messages)
        try:
            return self.template.render(
                messages=checked, add_generation_prompt=True, **self.variables
            )
        except jinja2.TemplateError as e:
            raise InvalidArgument(
                f"model {self.model!r}'s chat template refused the messages: {e}"
            ) from None


def check_messages(messages: object) -> list[dict[str, str]]:
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
        out.append({"role": role, "content": _content(m.get("content"), i)})
    return out


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
