"""The worker's answers in OpenAI's shapes: a whole chat or completion, or its stream of
chunks, with n choices, logprobs and tool calls.

A unary worker answer carries every choice (`text_output` [n], `finish_reason` comma-
separated, `logprobs` a JSON list per choice); a stream's pieces each name their choice
(`index`), and each choice's last piece has its `finish_reason`. Logprobs come from the
worker as {"token", "bytes", "logprob", "top_logprobs"} per token: chat shows them as
`logprobs.content`, completions in the legacy shape (tokens, token_logprobs, top_logprobs,
text_offset). An answer in the tool format (tools.py) becomes `message.tool_calls` (and
`delta.tool_calls` pieces), finish_reason "tool_calls". Usage is OpenAI's shape, with
`prompt_tokens_details.cached_tokens` when the engine reports it; completion_tokens count
every choice, as billed.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from common import llm_protocol as llm
from protos import grpc_service_pb2 as pb
from router.http import tensors, tools
from router.http.errors import HttpError
from router.http.openai import Generation, int_param


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(reply: pb.ModelInferResponse) -> dict | None:
    prompt = int_param(reply, llm.PROMPT_TOKENS)
    completion = int_param(reply, llm.COMPLETION_TOKENS)
    if prompt is None and completion is None:
        return None
    out: dict[str, Any] = {
        "prompt_tokens": prompt or 0,
        "completion_tokens": completion or 0,
        "total_tokens": (prompt or 0) + (completion or 0),
    }
    cached = int_param(reply, llm.CACHED_TOKENS)
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _string_param(reply: pb.ModelInferResponse, name: str) -> str:
    p = reply.parameters.get(name)
    return p.string_param if p is not None else ""


def finish_reasons(reply: pb.ModelInferResponse) -> list[str]:
    return [_reason(r) for r in _string_param(reply, llm.FINISH_REASON).split(",")]


def _reason(worker: str) -> str:
    return "length" if worker == "length" else "stop"


def token_logprobs(reply: pb.ModelInferResponse, n: int) -> list[list[dict]]:
    """Each choice's logprob entries (unary: one list per choice; a piece: its choice's)."""
    raw = _string_param(reply, llm.RESPONSE_LOGPROBS)
    if not raw:
        return [[] for _ in range(n)]
    entries = json.loads(raw)
    return entries if entries and isinstance(entries[0], list) else [entries]


def chat_logprobs(entries: list[dict]) -> dict:
    def one(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e.get("bytes")}

    return {
        "content": [
            {**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs") or []]}
            for e in entries
        ]
    }


def legacy_logprobs(entries: list[dict], offset: int) -> dict:
    """Completions' shape; text_offset counts from `offset` (the choice's text so far)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries
        ],
        "text_offset": offsets,
    }


def message(g: Generation, text: str) -> tuple[dict, bool]:
    """A chat choice's message, and whether it calls tools."""
    if not g.tool_format:
        return {"role": "assistant", "content": text}, False
    answer = tools.read(text, final=True)
    if not answer.calls:
        return {"role": "assistant", "content": answer.content or ""}, False
    calls = [
        {"id": tools.call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in answer.calls
    ]  # fmt: skip
    return {"role": "assistant", "content": None, "tool_calls": calls}, True


def answer(g: Generation, rid: str, reply: pb.ModelInferResponse) -> dict:
    texts = tensors.output_texts(reply, llm.TEXT_OUTPUT) or [""]
    if len(texts) != g.n:
        raise HttpError(502, f"the worker answered {len(texts)} choices for n = {g.n}")
    reasons = finish_reasons(reply)
    logprobs = token_logprobs(reply, g.n) if g.logprobs is not None else None
    choices = []
    for i, text in enumerate(texts):
        reason = reasons[i] if i < len(reasons) else "stop"
        choice: dict[str, Any] = {"index": i, "logprobs": None}
        if g.chat:
            choice["message"], called = message(g, text)
            if called and reason == "stop":
                reason = "tool_calls"
            if logprobs is not None:
                choice["logprobs"] = chat_logprobs(logprobs[i])
        else:
            choice["text"] = text
            if logprobs is not None:
                start = len(text) - sum(len(e["token"]) for e in logprobs[i])
                choice["logprobs"] = legacy_logprobs(logprobs[i], max(start, 0))
        choice["finish_reason"] = reason
        choices.append(choice)
    return {
        "id": rid,
        "object": "chat.completion" if g.chat else "text_completion",
        "created": int(time.time()),
        "model": g.model,
        "choices": choices,
        "usage": usage(reply) or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


class Chunks:
    """The server-sent events of one streamed chat or completion, piece by piece."""

    def __init__(self, g: Generation, rid: str) -> None:
        self.g = g
        self.rid = rid
        self.created = int(time.time())
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.offsets = [0] * g.n  # completions' text_offset, per choice
        self.deltas = [tools.Deltas() for _ in range(g.n)] if g.tool_format else None

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

    def _choice(self, i: int, text: str | None, calls: list, entries: list | None) -> dict:
        logprobs = None
        if entries is not None and self.g.chat:
            logprobs = chat_logprobs(entries)
        elif entries is not None:
            logprobs = legacy_logprobs(entries, self.offsets[i])
        if not self.g.chat:
            self.offsets[i] += len(text or "")
            return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": None}
        delta: dict[str, Any] = {}
        if i not in self.started:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        self.started.add(i)
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def _end(self, i: int, reason: str) -> dict:
        self.finished.add(i)
        if self.deltas is not None and self.deltas[i].called and reason == "stop":
            reason = "tool_calls"
        if not self.g.chat:
            return {"index": i, "text": "", "logprobs": None, "finish_reason": reason}
        return {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}

    def first(self) -> bytes:
        """A streamed echo: the prompt, before anything is generated."""
        if not (self.g.echo and self.g.prompt):
            return b""
        return self._chunk([self._choice(i, self.g.prompt, [], None) for i in range(self.g.n)])

    def events(self, reply: pb.ModelInferResponse) -> bytes:
        """The events one worker response makes (the last one ends the stream)."""
        i = int_param(reply, llm.INDEX) or 0
        text = tensors.output_text(reply, llm.TEXT_OUTPUT)
        final = llm.is_final(reply.parameters)
        reason = _string_param(reply, llm.FINISH_REASON)
        entries = token_logprobs(reply, 1)[0] if self.g.logprobs is not None else None
        used = usage(reply)
        continuous = self.g.continuous_usage and self.g.include_usage
        calls: list = []
        if self.deltas is not None and i < len(self.deltas):
            text, calls = self.deltas[i].feed(text, final=bool(reason) or final)
        out = b""
        if text or calls or entries or (i not in self.started and not reason):
            out += self._chunk([self._choice(i, text, calls, entries)], used, continuous)
        if reason and i not in self.finished:
            out += self._chunk([self._end(i, _reason(reason))], used, continuous)
        if final:
            for j in range(self.g.n):
                if j not in self.finished:
                    out += self._chunk([self._end(j, "stop")], used, continuous)
            if self.g.include_usage:
                out += self._chunk([], used, True)
            out += b"data: [DONE]\n\n"
        return out


def error_event(error: HttpError) -> bytes:
    return b"data: " + error.openai() + b"\n\n" + b"data: [DONE]\n\n"
