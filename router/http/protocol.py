"""OpenAI's request bodies as pydantic models, checked before anything reaches the mesh.

The shape follows vLLM's `vllm/entrypoints/openai/protocol.py`: one model per endpoint
(chat completions, completions, embeddings, responses) over shared parts, with vLLM's
extensions (`top_k`, `guided_json`, ...). Unlike vLLM, unknown fields are refused, not
logged: nothing a client sends is ignored silently. Fields OpenAI defines that the mesh
cannot give are refused by name with the reason (REFUSED). Every refusal is a 400 whose
`param` names the field (`messages[0].role`, `tools[1].function.name`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from common import llm_protocol as llm
from router.http.errors import HttpError

MAX_N, MAX_TOP_LOGPROBS = llm.MAX_N, llm.MAX_LOGPROBS
MAX_EMBEDDING_INPUTS = 2048
NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names

REFUSED = {  # fields OpenAI defines that the mesh cannot give, and why
    "functions": "the deprecated functions API is not served: send tools",
    "function_call": "the deprecated functions API is not served: send tool_choice",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix (insertion) is not supported",
    "dimensions": "the model's embedding size is fixed",
    "audio": "audio is not supported",
    "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "previous_response_id": "responses are not stored: send the whole conversation as input",
    "conversation": "responses are not stored: send the whole conversation as input",
    "background": "background responses are not supported",
}


def bad(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", param)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


def check_schema(schema: dict, param: str) -> None:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise bad(param, f"not a valid JSON schema: {e.message[:200]}") from None


def one_of(*models: type[BaseModel], default: str | None = None) -> Any:
    """A union picked by the object's `type` (a missing type means `default`), whose error
    names the allowed types instead of pydantic's union tags."""
    tags = {m.model_fields["type"].default or m.__name__: m for m in models}

    def pick(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else None
        return tags[kind].__name__ if kind in tags else None

    options = tuple(Annotated[m, Tag(m.__name__)] for m in models)
    error = f"an object with type one of {sorted(tags)} expected"
    return Annotated[
        Union[options],  # noqa: UP007 (a tuple of types: the | form cannot spell it)
        Discriminator(pick, custom_error_type="type_invalid", custom_error_message=error),
    ]


# -- parts shared by chat and responses -------------------------------------------------------


class FunctionDef(Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class CalledFunction(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(Strict):
    type: Literal["text"] = "text"
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class JsonSchema(Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text"] = "text"


class JsonObjectFormat(Strict):
    type: Literal["json_object"] = "json_object"


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"] = "json_schema"
    json_schema: JsonSchema


if TYPE_CHECKING:
    ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
else:  # the same union, picked by `type` (mypy cannot read one_of's result as a type)
    ResponseFormat = one_of(TextFormat, JsonObjectFormat, JsonSchemaFormat)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# -- chat completions and completions ---------------------------------------------------------


class Sampling(Strict):
    """What chat completions and completions share: the model, sampling, streaming, and
    vLLM's extensions (the engine's own sampling and guided-decoding keys)."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _shared(self) -> Sampling:
        if self.stream_options is not None and not self.stream:
            raise bad("stream_options", "only with stream: true")
        guided = [k for k in GUIDED if getattr(self, k) is not None]
        if len(guided) > 1:
            raise bad(guided[1], f"one constraint per request, got {guided}")
        if isinstance(self.guided_json, str):
            try:
                self.guided_json = json.loads(self.guided_json)
            except ValueError:
                raise bad("guided_json", "a JSON schema (object or JSON text) expected") from None
        if isinstance(self.guided_json, dict):
            check_schema(self.guided_json, "guided_json")
        elif self.guided_json is not None:
            raise bad("guided_json", "a JSON schema (object or JSON text) expected")
        return self

    def guided(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in GUIDED if getattr(self, k) is not None}


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _chat(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:  # 0 too, as OpenAI
            raise bad("top_logprobs", "only with logprobs: true")
        for i, m in enumerate(self.messages):
            _check_message(m, f"messages[{i}]")
        check_tools([t.function for t in self.tools or []], "tools[{}].function")
        names = [t.function.name for t in self.tools or []]
        check_choice(self.tool_choice, names, "tool_choice")
        if isinstance(self.response_format, JsonSchemaFormat):
            check_schema(self.response_format.json_schema.schema_, "response_format.json_schema")
        if self.response_format is not None and self.guided():
            raise bad("response_format", f"not with {next(iter(self.guided()))}: one constraint")
        if self.tools and self.tool_choice != "none" and self.guided():
            raise bad("tools", f"not with {next(iter(self.guided()))}: one constraint")
        return self


def _check_message(m: Message, where: str) -> None:
    if m.tool_calls is not None and m.role != "assistant":
        raise bad(f"{where}.tool_calls", "only on an assistant message")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise bad(f"{where}.content", "a string or a list of text parts expected")
    if m.role == "tool" and m.tool_call_id is None:
        raise bad(f"{where}.tool_call_id", "a tool message answers a call: its id expected")


def check_tools(functions: list[FunctionDef], where: str) -> None:
    seen = set()
    for i, f in enumerate(functions):
        if f.name in seen:
            raise bad(where.format(i) + ".name", f"{f.name!r} is named twice")
        seen.add(f.name)
        if f.parameters is not None:
            check_schema(f.parameters, where.format(i) + ".parameters")


def check_choice(choice: object, names: list[str], param: str) -> None:
    if choice in (None, "none", "auto"):
        return
    if not names:
        raise bad(param, "names a tool, but the request has no tools")
    name = getattr(getattr(choice, "function", choice), "name", None)
    if name is not None and name not in names:
        raise bad(param, f"names {name!r}, which is not one of the tools {names}")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise bad("best_of", "only equal to n (every candidate is returned)")
        if self.echo and self.logprobs is not None:
            raise bad("echo", "not with logprobs: the prompt's logprobs are not computed")
        prompt = self.prompt
        if isinstance(prompt, list):
            if not prompt:
                raise bad("prompt", "a non-empty string or list of token ids expected")
            if len(prompt) > 1 and isinstance(prompt[0], str | list):
                raise bad("prompt", "one prompt per request (send several requests)")
            if isinstance(prompt[0], str | list):
                self.prompt = prompt = prompt[0]
            if isinstance(prompt, list) and not prompt:
                raise bad("prompt", "a non-empty list of token ids expected")
            if isinstance(prompt, list) and any(x < 0 for x in prompt if isinstance(x, int)):
                raise bad("prompt", "token ids are >= 0")
        return self


class EmbeddingRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @model_validator(mode="after")
    def _input(self) -> EmbeddingRequest:
        rows = [self.input] if isinstance(self.input, str) else self.input
        if not rows or len(rows) > MAX_EMBEDDING_INPUTS:
            raise bad("input", f"1 to {MAX_EMBEDDING_INPUTS} inputs expected, got {len(rows)}")
        if isinstance(rows[0], list) and any(not r for r in rows):
            raise bad("input", "token-id inputs must not be empty")
        return self

    def texts(self) -> list[str] | None:
        if isinstance(self.input, str):
            return [self.input]
        return self.input if isinstance(self.input[0], str) else None  # type: ignore[return-value]

    def token_rows(self) -> list[list[int]]:
        rows = self.input
        assert isinstance(rows, list) and not isinstance(rows[0], str)
        return rows if isinstance(rows[0], list) else [rows]  # type: ignore[list-item,return-value]


# -- parsing --------------------------------------------------------------------------------


def parse(model: type[Strict], doc: dict) -> Any:
    """The body as `model`, or a 400 naming the first bad field."""
    for key in doc:
        if key in REFUSED:
            raise bad(key, REFUSED[key])
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # Of a union's errors (one per member), the deepest says most: content[0].type
        # rather than "content: a string expected".
        first = param_of(errors[0]["loc"]).split(".")[0].split("[")[0]
        error = max(
            (x for x in errors if param_of(x["loc"]).split(".")[0].split("[")[0] == first),
            key=lambda x: len(param_of(x["loc"])),
        )
        param = param_of(error["loc"])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "not a field of this endpoint (or not supported)"
        elif error["type"] == "missing":
            message = "required"
        raise bad(param or "body", message) from None


TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list"}


def param_of(loc: tuple) -> str:
    """A pydantic error location as OpenAI names a field: `messages[0].content`. Union
    branch names (a type's name, `literal[...]`, `list[...]`) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part[:1].isupper() or part in TYPE_NAMES or any(c in part for c in "[]'(),"):
            continue
        else:
            out += ("." if out else "") + ("schema" if part == "schema_" else part)
    return out
