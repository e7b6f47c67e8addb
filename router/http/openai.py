"""OpenAI's API over the mesh's LLM and embedding tensors: checked requests become worker
requests (common/llm_protocol names, Triton's vLLM-backend tensors).

A chat sends its `messages` as JSON for the worker to render with the model's own chat
template; a completion sends its `prompt` as `text_input`, or its token ids as `input_ids`;
both send their sampling fields as `sampling_parameters`, with vLLM's keys for `n`,
`logprobs` and structured output: `response_format` json_object becomes
`guided_json_object`, json_schema `guided_json`. Tools (tool_choice other than none) use
llama.cpp's generic format (tools.py): the tools go to the template as the `tools` input,
the answer is constrained to its JSON schema and read back into `tool_calls`
(answers.py). An embedding request sends its strings as rows of `TEXT`, or its token ids
as `input_ids` and `attention_mask`.
"""

from __future__ import annotations

import base64
import json
import struct
from array import array
from dataclasses import dataclass, field
from typing import Any

from common import bytes_codec
from common import llm_protocol as llm
from protos import grpc_service_pb2 as pb
from router.http import protocol, tensors, tools
from router.http.errors import HttpError

DEFAULT_MAX_TOKENS = 256

# OpenAI (and vLLM) request fields -> the engine's sampling keys (worker/llm/sampling.py).
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
}


@dataclass(frozen=True)
class Generation:
    """A checked chat, completion or response request, as the worker will get it."""

    model: str
    chat: bool
    stream: bool
    sampling: dict[str, Any]
    n: int = 1
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    prompt: str | None = None  # a completion's text
    prompt_ids: list[int] | None = None  # a completion's token ids
    messages: list | None = None  # a chat
    tools: list | None = None  # the `tools` input: OpenAI's chat tool objects
    tool_format: bool = False  # answers are tools.py's JSON: read them into tool_calls
    logprobs: int | None = None  # top alternatives per token (0: the token's own only)
    extra: dict[str, Any] = field(default_factory=dict)  # what an endpoint keeps for its answer


def sampling_of(req: protocol.Sampling, max_tokens: int | None) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": max_tokens or DEFAULT_MAX_TOKENS}
    for name, key in SAMPLING_FIELDS.items():
        value = getattr(req, name)
        if value is not None and name != "max_tokens":
            sampling[key] = [value] if name == "stop" and isinstance(value, str) else value
    if req.n != 1:
        sampling[llm.N] = req.n
    guided = req.guided()
    for key, value in guided.items():
        sampling[key] = value
    return sampling


def tool_setup(
    functions: list[dict],
    choice: str | None,
    named: str | None,
    parallel: bool,
    messages: list[dict],
    response: dict | None,
) -> tuple[list[dict], list[dict] | None, dict | None]:
    """(messages, the tools input, the answer's schema) for tools in the generic format;
    tool_choice none (or no tools) leaves the messages as they are."""
    if not functions or choice == "none":
        return messages, None, None
    if named is not None:
        functions = [f for f in functions if f["name"] == named]
    required = named is not None or choice == "required"
    chat_tools = [{"type": "function", "function": f} for f in functions]
    answer = tools.schema(functions, required, parallel and named is None, response)
    return tools.with_instruction(messages), chat_tools, answer


def chat(req: protocol.ChatRequest) -> Generation:
    sampling = sampling_of(req, req.max_completion_tokens or req.max_tokens)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    fmt = req.response_format
    response = None
    if isinstance(fmt, protocol.JsonSchemaFormat):
        response = fmt.json_schema.schema_
    elif isinstance(fmt, protocol.JsonObjectFormat):
        response = {"type": "object"}
    choice = req.tool_choice if isinstance(req.tool_choice, str) else None
    named = (
        req.tool_choice.function.name
        if isinstance(req.tool_choice, protocol.NamedToolChoice)
        else None
    )
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    messages, chat_tools, answer = tool_setup(
        functions, choice, named, req.parallel_tool_calls, messages, response
    )
    if answer is not None:
        sampling[llm.GUIDED_JSON] = answer
    elif isinstance(fmt, protocol.JsonSchemaFormat):
        sampling[llm.GUIDED_JSON] = tools.closed(response)
    elif isinstance(fmt, protocol.JsonObjectFormat):
        sampling[llm.GUIDED_JSON_OBJECT] = True
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if logprobs is not None:
        sampling[llm.LOGPROBS] = logprobs
    options = req.stream_options or protocol.StreamOptions()
    return Generation(
        req.model, True, req.stream, sampling, req.n, options.include_usage,
        options.continuous_usage_stats, messages=messages, tools=chat_tools,
        tool_format=answer is not None, logprobs=logprobs,
    )  # fmt: skip


def completion(req: protocol.CompletionRequest) -> Generation:
    sampling = sampling_of(req, req.max_tokens)
    if req.logprobs is not None:
        sampling[llm.LOGPROBS] = req.logprobs
    prompt, ids = (req.prompt, None) if isinstance(req.prompt, str) else (None, req.prompt)
    if req.echo and req.stream and ids is not None:
        raise protocol.bad("echo", "a streamed echo needs a text prompt, not token ids")
    options = req.stream_options or protocol.StreamOptions()
    return Generation(
        req.model, False, req.stream, sampling, req.n, options.include_usage,
        options.continuous_usage_stats, req.echo, prompt, ids,  # type: ignore[arg-type]
        logprobs=req.logprobs,
    )  # fmt: skip


def _bytes_input(request: pb.ModelInferRequest, name: str, texts: list[str]) -> None:
    request.inputs.add(name=name, datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(bytes_codec.join(t.encode() for t in texts))


def _bool_input(request: pb.ModelInferRequest, name: str, value: bool) -> None:
    request.inputs.add(name=name, datatype="BOOL", shape=[1])
    request.raw_input_contents.append(b"\x01" if value else b"\x00")


def _ids_input(request: pb.ModelInferRequest, name: str, rows: list[list[int]]) -> None:
    request.inputs.add(name=name, datatype="INT64", shape=[len(rows), len(rows[0])])
    flat = [x for row in rows for x in row]
    try:
        request.raw_input_contents.append(struct.pack(f"<{len(flat)}q", *flat))
    except struct.error:
        raise protocol.bad("input" if len(rows) > 1 else "prompt", "token ids are int64") from None


def worker_request(g: Generation, request_id: str) -> bytes:
    request = pb.ModelInferRequest(model_name=g.model, id=request_id)
    if g.messages is not None:
        _bytes_input(request, llm.MESSAGES, [json.dumps(g.messages)])
    elif g.prompt_ids is not None:
        _ids_input(request, llm.INPUT_IDS, [g.prompt_ids])
        request.inputs[-1].shape[:] = [len(g.prompt_ids)]
    else:
        assert g.prompt is not None
        _bytes_input(request, llm.TEXT_INPUT, [g.prompt])
    if g.tools is not None:
        _bytes_input(request, llm.TOOLS, [json.dumps(g.tools)])
    _bool_input(request, llm.STREAM, g.stream)
    _bytes_input(request, llm.SAMPLING_PARAMETERS, [json.dumps(g.sampling)])
    # a streamed echo is the router's (the worker never repeats the prompt in a stream)
    _bool_input(request, llm.EXCLUDE_INPUT_IN_OUTPUT, not g.echo or g.stream)
    return request.SerializeToString()


# -- embeddings --------------------------------------------------------------------------


def embedding_request(e: protocol.EmbeddingRequest, request_id: str) -> bytes:
    """Strings as TEXT rows; token ids as input_ids with their attention_mask, padded
    right to the longest row (the model's own inputs: worker/text.py passes them on)."""
    request = pb.ModelInferRequest(model_name=e.model, id=request_id)
    texts = e.texts()
    if texts is not None:
        request.inputs.add(name=llm.TEXT, datatype="BYTES", shape=[len(texts), 1])
        request.raw_input_contents.append(bytes_codec.join(t.encode() for t in texts))
        return request.SerializeToString()
    rows = e.token_rows()
    width = max(len(r) for r in rows)
    _ids_input(request, "input_ids", [r + [0] * (width - len(r)) for r in rows])
    _ids_input(request, "attention_mask", [[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return request.SerializeToString()


def embedding_answer(e: protocol.EmbeddingRequest, reply: pb.ModelInferResponse) -> dict:
    rows_in = len(e.texts() or e.token_rows())
    found = tensors.output_floats(reply)
    if found is None or len(found[1]) != 2 or found[1][0] != rows_in:
        raise HttpError(400, f"model {e.model!r} does not return one embedding per input", "model")
    values, (rows, width) = found
    data = []
    for i in range(rows):
        row = values[i * width : (i + 1) * width]
        b64 = e.encoding_format == "base64"
        vector: Any = base64.b64encode(array("f", row).tobytes()).decode() if b64 else row
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = int_param(reply, llm.PROMPT_TOKENS) or 0
    return {
        "object": "list",
        "data": data,
        "model": e.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def int_param(reply: pb.ModelInferResponse, name: str) -> int | None:
    p = reply.parameters.get(name)
    if p is None or p.WhichOneof("parameter_choice") != "int64_param":
        return None
    return int(p.int64_param)
