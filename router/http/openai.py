"""OpenAI's API over the mesh's LLM and embedding tensors: requests checked, answers shaped.

A request becomes a worker request (Triton's vLLM-backend tensors, common/llm_protocol
names): a chat sends its `messages` as JSON for the worker to render with the model's own
chat template; a completion sends its `prompt` as `text_input`; both send their sampling
fields as `sampling_parameters`. An embedding request sends each input string as a row of
`TEXT`. Every field OpenAI defines that the mesh cannot honour is refused by name (400), not
ignored; unknown fields too. Usage is OpenAI's shape, with
`prompt_tokens_details.cached_tokens` when the engine reports `cached_tokens`.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from array import array
from dataclasses import dataclass
from typing import Any

from common import bytes_codec
from common import llm_protocol as llm
from protos import grpc_service_pb2 as pb
from router.http import tensors
from router.http.errors import HttpError

TEXT_INPUT, TEXT_OUTPUT, MESSAGES = llm.TEXT_INPUT, llm.TEXT_OUTPUT, llm.MESSAGES
STREAM, SAMPLING, EXCLUDE = llm.STREAM, llm.SAMPLING_PARAMETERS, llm.EXCLUDE_INPUT_IN_OUTPUT
PROMPT_TOKENS, COMPLETION_TOKENS = llm.PROMPT_TOKENS, llm.COMPLETION_TOKENS
CACHED_TOKENS, FINISH_REASON = llm.CACHED_TOKENS, llm.FINISH_REASON
DEFAULT_MAX_TOKENS = 256

# OpenAI fields -> the engine's sampling keys (worker/llm/sampling.py).
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    # vLLM's extensions, which the engine has too
    "top_k": "top_k",
    "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
}
COMMON = {"model", "n", "stream", "stream_options", "user", "logprobs", *SAMPLING_FIELDS}
CHAT_FIELDS = COMMON | {"messages"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "user"}
REFUSED = {  # fields OpenAI defines that the engine cannot give, and why
    "tools": "tool calls are not supported",
    "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "response_format": "structured output is not supported",
    "logit_bias": "logit_bias is not supported",
    "top_logprobs": "logprobs are not supported",
    "suffix": "suffix (insertion) is not supported",
    "dimensions": "the model's embedding size is fixed",
    "parallel_tool_calls": "tool calls are not supported",
    "audio": "audio is not supported",
    "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported",
}


def _bad(message: str, param: str) -> HttpError:
    return HttpError(400, message, param)


def _fields(doc: dict, allowed: set[str]) -> None:
    for key in doc:
        if key in REFUSED:
            raise _bad(f"{key}: {REFUSED[key]}", key)
        if key not in allowed:
            raise _bad(f"{key}: not a field of this endpoint (or not supported)", key)


def model_of(doc: dict) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model: a model name (string) expected", "model")
    return model


@dataclass(frozen=True)
class Generation:
    """A checked chat or completion request."""

    model: str
    chat: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: bool
    prompt: str | None  # completion
    messages: list | None  # chat
    sampling: dict[str, Any]


def generation(doc: dict, chat: bool) -> Generation:
    _fields(doc, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = model_of(doc)
    for key, one in (("n", 1), ("best_of", 1)):
        if key in doc and doc[key] not in (None, one):
            raise _bad(f"{key}: only {one} is supported", key)
    if doc.get("logprobs") not in (None, False, 0):
        raise _bad("logprobs: not supported (the engine does not report them)", "logprobs")
    stream = _bool(doc, "stream")
    options = doc.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _bad("stream_options: an object, and only with stream: true", "stream_options")
    options = options or {}
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise _bad(f"stream_options.{key}: not supported", f"stream_options.{key}")
    include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    continuous = _bool(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    sampling: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for key, target in SAMPLING_FIELDS.items():
        value = doc.get(key)
        if value is None:
            continue
        if key == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise _bad("stop: a string or a list of strings expected", "stop")
        elif key == "ignore_eos":
            value = _bool(doc, key)
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(f"{key}: a number expected, got {type(value).__name__}", key)
        sampling[target] = value
    if chat:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages: a non-empty list of {role, content} objects expected", "messages")
        return Generation(
            model, True, stream, include_usage, continuous, False, None, messages, sampling
        )
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("prompt: a string (or a list of one string) expected", "prompt")
    echo = _bool(doc, "echo")
    return Generation(model, False, stream, include_usage, continuous, echo, prompt, None, sampling)


def _bool(doc: dict, key: str, name: str | None = None) -> bool:
    value = doc.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{name or key}: true or false expected", name or key)
    return value


def _bytes_input(request: pb.ModelInferRequest, name: str, texts: list[str]) -> None:
    request.inputs.add(name=name, datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(bytes_codec.join(t.encode() for t in texts))


def _bool_input(request: pb.ModelInferRequest, name: str, value: bool) -> None:
    request.inputs.add(name=name, datatype="BOOL", shape=[1])
    request.raw_input_contents.append(b"\x01" if value else b"\x00")


def worker_request(g: Generation, request_id: str) -> bytes:
    request = pb.ModelInferRequest(model_name=g.model, id=request_id)
    if g.chat:
        _bytes_input(request, MESSAGES, [json.dumps(g.messages)])
    else:
        assert g.prompt is not None
        _bytes_input(request, TEXT_INPUT, [g.prompt])
    _bool_input(request, STREAM, g.stream)
    _bytes_input(request, SAMPLING, [json.dumps(g.sampling)])
    _bool_input(request, EXCLUDE, not g.echo)
    return request.SerializeToString()


@dataclass(frozen=True)
class Embedding:
    model: str
    texts: list[str]
    base64: bool


def embedding(doc: dict) -> Embedding:
    _fields(doc, EMBEDDING_FIELDS)
    model = model_of(doc)
    texts = doc.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise _bad("input: a string or a non-empty list of strings expected", "input")
    if len(texts) > 2048:
        raise _bad(f"input: at most 2048 strings, got {len(texts)}", "input")
    encoding = doc.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise _bad("encoding_format: 'float' or 'base64' expected", "encoding_format")
    return Embedding(model, texts, encoding == "base64")


def embedding_request(e: Embedding, request_id: str) -> bytes:
    request = pb.ModelInferRequest(model_name=e.model, id=request_id)
    request.inputs.add(name=llm.TEXT, datatype="BYTES", shape=[len(e.texts), 1])
    request.raw_input_contents.append(bytes_codec.join(t.encode() for t in e.texts))
    return request.SerializeToString()


def embedding_answer(e: Embedding, reply: pb.ModelInferResponse) -> dict:
    found = tensors.output_floats(reply)
    if found is None or len(found[1]) != 2 or found[1][0] != len(e.texts):
        raise HttpError(400, f"model {e.model!r} does not return one embedding per input", "model")
    values, (rows, width) = found
    data = []
    for i in range(rows):
        row = values[i * width : (i + 1) * width]
        vector: Any = base64.b64encode(array("f", row).tobytes()).decode() if e.base64 else row
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = _int_param(reply, PROMPT_TOKENS) or 0
    return {
        "object": "list",
        "data": data,
        "model": e.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


# -- answers -------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _int_param(reply: pb.ModelInferResponse, name: str) -> int | None:
    p = reply.parameters.get(name)
    if p is None or p.WhichOneof("parameter_choice") != "int64_param":
        return None
    return int(p.int64_param)


def usage(reply: pb.ModelInferResponse) -> dict | None:
    prompt, completion = _int_param(reply, PROMPT_TOKENS), _int_param(reply, COMPLETION_TOKENS)
    if prompt is None and completion is None:
        return None
    out: dict[str, Any] = {
        "prompt_tokens": prompt or 0,
        "completion_tokens": completion or 0,
        "total_tokens": (prompt or 0) + (completion or 0),
    }
    cached = _int_param(reply, CACHED_TOKENS)
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def finish_reason(reply: pb.ModelInferResponse) -> str | None:
    p = reply.parameters.get(FINISH_REASON)
    if p is None or not p.string_param:
        return None
    return "length" if p.string_param == "length" else "stop"


def answer(g: Generation, rid: str, reply: pb.ModelInferResponse) -> dict:
    text = tensors.output_text(reply, TEXT_OUTPUT)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(reply) or "stop"}
    choice["logprobs"] = None
    if g.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": rid,
        "object": "chat.completion" if g.chat else "text_completion",
        "created": int(time.time()),
        "model": g.model,
        "choices": [choice],
        "usage": usage(reply) or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


class Chunks:
    """The server-sent events of one streamed chat or completion, piece by piece."""

    def __init__(self, g: Generation, rid: str) -> None:
        self.g = g
        self.rid = rid
        self.created = int(time.time())
        self.started = False

    def _chunk(self, choices: list, usage_: dict | None = None, with_usage: bool = False) -> bytes:
        body: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.g.chat else "text_completion",
            "created": self.created,
            "model": self.g.model,
            "choices": choices,
        }
        if with_usage:
            body["usage"] = usage_
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def _choice(self, text: str | None, finish: str | None) -> dict:
        if self.g.chat:
            delta: dict[str, Any] = {}
            if not self.started:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            self.started = True
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def events(self, reply: pb.ModelInferResponse) -> bytes:
        """The events one worker response makes (the last one ends the stream)."""
        text = tensors.output_text(reply, TEXT_OUTPUT)
        final = llm.is_final(reply.parameters)
        used = usage(reply)
        continuous = self.g.continuous_usage and self.g.include_usage
        out = b""
        if text or (not final and not self.started):
            out += self._chunk([self._choice(text, None)], used, continuous)
        if final:
            reason = finish_reason(reply) or "stop"
            out += self._chunk([self._choice(None, reason)], used, continuous)
            if self.g.include_usage:
                out += self._chunk([], used, True)
            out += b"data: [DONE]\n\n"
        return out


def error_event(error: HttpError) -> bytes:
    return b"data: " + error.openai() + b"\n\n" + b"data: [DONE]\n\n"
