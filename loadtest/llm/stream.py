"""One request of Triton's LLM interface (its vLLM backend's tensors) over ModelStreamInfer,
timed piece by piece. Protobuf stays in this module.

Each in-flight request has its own ModelStreamInfer call (all on one HTTP/2 channel): it
writes one request, reads until the response flagged `triton_final_response` (the request
asks for an empty final response, as tritonclient and genai-perf do, so the end is seen
even when the last piece has text), then half-closes. One stream a request keeps the
failure of one request (a reset, a deadline) from touching the others, and costs a stream
set-up that is tiny beside a generation.

Token counts, best source first: `num_output_tokens` / `num_input_tokens` output tensors
(Triton's vLLM backend sends them per response when asked with `return_num_*_tokens`), the
`completion_tokens` / `prompt_tokens` parameters of the final response (meshserve), else
the caller tokenizes the text itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from client import codec
from common import llm_protocol, tls
from common.rpc import message_options
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

EMPTY_FINAL = llm_protocol.EMPTY_FINAL_RESPONSE
TEXT_OUTPUT = llm_protocol.TEXT_OUTPUT


@dataclass
class Outcome:
    """What one request saw; times on the event loop's clock (seconds)."""

    start: float  # when it was due (scheduled arrival in an open loop, else sent)
    end: float = 0.0  # the final response, or the error
    pieces: list[float] = field(default_factory=list)  # arrival of each non-empty piece
    piece_tokens: list[int] = field(default_factory=list)  # per piece, when the server says
    text: str = ""
    error: str | None = None  # a gRPC code name, or "stream: <message>"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served
    shed: bool = False  # refused for overload (RESOURCE_EXHAUSTED, HTTP 429)
    retry_after: str | None = None  # what the refusal said to wait (seconds), if it did


def build_request(
    model: str,
    text: str,
    sampling: dict,
    version: str = "",
    request_id: str = "",
    return_token_counts: bool = False,
) -> pb.ModelInferRequest:
    inputs: dict[str, np.ndarray] = {
        llm_protocol.TEXT_INPUT: _bytes(text.encode()),
        llm_protocol.STREAM: np.array([True]),
        llm_protocol.SAMPLING_PARAMETERS: _bytes(json.dumps(sampling).encode()),
        llm_protocol.EXCLUDE_INPUT_IN_OUTPUT: np.array([True]),
    }
    if return_token_counts:
        inputs[llm_protocol.RETURN_NUM_INPUT_TOKENS] = np.array([True])
        inputs[llm_protocol.RETURN_NUM_OUTPUT_TOKENS] = np.array([True])
    request = codec.infer_request(model, inputs, version=version, request_id=request_id)
    request.parameters[EMPTY_FINAL].bool_param = True
    return request


def _bytes(data: bytes) -> np.ndarray:
    array = np.empty(1, dtype=object)
    array[0] = data
    return array


class Streams:
    """The channel every request's stream shares."""

    def __init__(
        self,
        address: str,
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
    ) -> None:
        self.channel = tls.aio_channel(address, credentials, message_options())
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self,
        request: pb.ModelInferRequest,
        start: float,
        timeout: float,
        clock: Callable[[], float],
        on_piece: Callable[[], None] = lambda: None,
    ) -> Outcome:
        """Send `request` on its own stream and time every response until the final one;
        `on_piece` is called as each non-empty piece arrives (a live progress count)."""
        out = Outcome(start)
        call = self.stub.ModelStreamInfer(timeout=timeout, metadata=self.metadata)
        try:
            await call.write(request)
            while True:
                reply = await call.read()
                now = clock()
                if reply is grpc.aio.EOF:
                    out.error = "stream: ended before the final response"
                    break
                if reply.error_message:
                    out.error = "stream: " + _bounded(reply.error_message)
                    out.shed = reply.error_message.startswith("RESOURCE_EXHAUSTED")
                    retry = reply.infer_response.parameters.get("retry-after")
                    out.retry_after = retry.string_param if retry is not None else None
                    break
                pieces = len(out.pieces)
                final = _record(out, reply.infer_response, now)
                if len(out.pieces) > pieces:
                    on_piece()
                if final:
                    break
            await call.done_writing()
        except grpc.aio.AioRpcError as e:
            out.error = e.code().name
            out.shed = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            out.retry_after = dict(e.trailing_metadata() or ()).get("retry-after")
        finally:
            out.end = clock()
            call.cancel()  # a no-op once the server has closed it
        return out


def _record(out: Outcome, response: pb.ModelInferResponse, now: float) -> bool:
    """Note one response; True when it is the request's last."""
    result = codec.infer_result(response)
    text = result.outputs.get(TEXT_OUTPUT)
    piece = b"".join(text.reshape(-1)).decode("utf-8", "replace") if text is not None else ""
    counts = result.outputs.get(llm_protocol.NUM_OUTPUT_TOKENS)
    if piece:
        out.pieces.append(now)
        out.text += piece
        if counts is not None:
            out.piece_tokens.append(int(counts.reshape(-1)[0]))
    elif counts is not None and out.piece_tokens:
        out.piece_tokens[-1] += int(counts.reshape(-1)[0])
    prompt = result.outputs.get(llm_protocol.NUM_INPUT_TOKENS)
    if prompt is not None:
        out.prompt_tokens = int(prompt.reshape(-1)[0])
    params = response.parameters
    if llm_protocol.PROMPT_TOKENS in params:
        out.prompt_tokens = int(params[llm_protocol.PROMPT_TOKENS].int64_param)
    if llm_protocol.COMPLETION_TOKENS in params:
        out.completion_tokens = int(params[llm_protocol.COMPLETION_TOKENS].int64_param)
    if llm_protocol.CACHED_TOKENS in params:
        out.cached_tokens = int(params[llm_protocol.CACHED_TOKENS].int64_param)
    if llm_protocol.FINISH_REASON in params:
        out.finish_reason = params[llm_protocol.FINISH_REASON].string_param
    final = llm_protocol.is_final(params)
    if final and out.completion_tokens is None and out.piece_tokens:
        out.completion_tokens = sum(out.piece_tokens)
    return final


def _bounded(message: str, limit: int = 160) -> str:
    """An error message as a bounded key: numbers folded to N, cut at `limit`."""
    return re.sub(r"\b\d+\b", "N", message.strip())[:limit]
