"""Chat templates rendered as Hugging Face renders them: SmolLM2's own (from its GGUF) and a
template using the sandbox's extras, checked against transformers' renderer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from common.errors import InvalidArgument
from quantize import weights
from worker.config import ConfigError
from worker.llm.chat import ChatTemplate

CONVERSATIONS = [
    [{"role": "user", "content": "Write a short story about a robot number 3."}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}],
        },
    ],
]
EXTRAS = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% set ns.n = ns.n + 1 %}{{ m | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}[{{ ns.n }}]{{ eos_token }}{% endif %}"
)


def folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def reference(template: str, config: dict, messages: list) -> str:
    flat = [
        {**m, "content": "".join(p["text"] for p in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    tokens = {k: config[k] for k in ("bos_token", "eos_token") if k in config}
    rendered = render_jinja_template(
        [flat], chat_template=template, add_generation_prompt=True, **tokens
    )
    return rendered[0][0] if isinstance(rendered, tuple) else rendered[0]


@pytest.fixture(scope="module")
def smollm2_config() -> dict:
    """Read once: GGUFReader parses the whole vocabulary (~10 s here)."""
    return weights.smollm2_tokenizer_config()


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_template_renders_as_hugging_face_does(
    tmp_path: Path, messages: list, smollm2_config: dict
) -> None:
    config = json.loads(json.dumps(smollm2_config))  # each test its own copy
    chat = ChatTemplate.from_folder(folder(tmp_path, config), "smollm2")
    assert chat is not None
    got = chat.render(messages)
    assert got == reference(config["chat_template"], config, messages)
    assert got.endswith("<|im_start|>assistant\n")  # the generation prompt


def test_sandbox_extras_render_as_hugging_face_does(tmp_path: Path) -> None:
    config = {"chat_template": EXTRAS, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    chat = ChatTemplate.from_folder(folder(tmp_path, config), "m")
    assert chat is not None
    messages = [{"role": "user", "content": "é <b>"}]
    want = reference(EXTRAS, {"bos_token": "<s>", "eos_token": "</s>"}, messages)
    assert chat.render(messages) == want == '<s>{"role": "user", "content": "é <b>"}\n[1]</s>'


@pytest.mark.parametrize(
    ("messages", "names"),
    [
        ([], "messages: a non-empty list"),
        ({"role": "user"}, "messages: a non-empty list"),
        (["hi"], "messages[0]: an object expected"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ],
)
def test_bad_messages_name_the_field(tmp_path: Path, messages: object, names: str) -> None:
    chat = ChatTemplate.from_folder(folder(tmp_path, {"chat_template": EXTRAS}), "m")
    assert chat is not None
    with pytest.raises(InvalidArgument, match=names.replace("[", r"\[").replace("]", r"\]")):
        chat.render(messages)


def test_a_template_that_refuses_is_invalid_argument(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    chat = ChatTemplate.from_folder(folder(tmp_path, {"chat_template": template}), "m")
    assert chat is not None
    with pytest.raises(InvalidArgument, match="user first"):
        chat.render([{"role": "assistant", "content": "x"}])


def test_no_template_and_a_broken_one(tmp_path: Path) -> None:
    assert ChatTemplate.from_folder(tmp_path, "m") is None
    assert ChatTemplate.from_folder(folder(tmp_path, {"eos_token": "x"}), "m") is None
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate.from_folder(folder(tmp_path, {"chat_template": "{% for %}"}), "m")


# -- tools ---------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALLED = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "-3C"},
]
# A template that shows tools, calls and tool answers itself (as Hermes-style ones do).
NATIVE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}CALLS {{ m.tool_calls | tojson }}\n"
    "{% elif m.role == 'tool' %}ANSWER {{ m.tool_call_id }} {{ m.content }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
)


def test_smollm2_template_gets_tools_calls_and_answers_as_text(
    tmp_path: Path, smollm2_config: dict
) -> None:
    """SmolLM2's template shows none of them: they are converted as llama.cpp's minja does."""
    chat = ChatTemplate.from_folder(folder(tmp_path, dict(smollm2_config)), "smollm2")
    assert chat is not None
    assert (chat.abilities.tools, chat.abilities.tool_calls) == (False, False)
    got = chat.render(CALLED, [WEATHER])
    system = got.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou can call any of the following tools")
    assert json.loads(system.split("requests: ", 1)[1]) == [WEATHER]
    shown = json.loads(got.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
    assert shown == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "call_7"}]
    }
    answer = json.loads(got.split("<|im_start|>user\n")[2].split("<|im_end|>")[0])
    assert answer == {"tool_response": {"content": "-3C", "tool_call_id": "call_7"}}
    assert got.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_gets_them_as_hugging_face_passes_them(tmp_path: Path) -> None:
    chat = ChatTemplate.from_folder(folder(tmp_path, {"chat_template": NATIVE}), "m")
    assert chat is not None
    assert (chat.abilities.tools, chat.abilities.tool_calls, chat.abilities.tool_responses) == (
        True,
        True,
        True,
    )
    want = render_jinja_template([CALLED], chat_template=NATIVE, tools=[WEATHER])[0][0]
    assert chat.render(CALLED, [WEATHER]) == want
    assert "TOOLS" not in chat.render(CALLED)


def test_bad_tools_and_tool_calls_name_the_field(tmp_path: Path) -> None:
    chat = ChatTemplate.from_folder(folder(tmp_path, {"chat_template": NATIVE}), "m")
    assert chat is not None
    with pytest.raises(InvalidArgument, match="tools: a list"):
        chat.render(CALLED, {"not": "a list"})
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]
    with pytest.raises(InvalidArgument, match=r"messages\[0\].tool_calls\[0\].function.name"):
        chat.render(bad)
