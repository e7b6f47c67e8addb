"""A streaming client of Triton's vLLM-backend interface over gRPC ModelStreamInfer, as
benchmarks/llm.py uses it against a meshserve worker (or any Triton server).

Request: text_input BYTES [1], stream BOOL [1], sampling_parameters BYTES [1] (JSON),
exclude_input_in_output BOOL [1]. Responses: text_output BYTES, one per piece of text; the
last carries the bool parameter `triton_final_response` (it may have no outputs at all) and,
where the server gives them, prompt_tokens / completion_tokens / finish_reason. A server
that never flags a final response is read until it closes the stream.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator

import grpc

from benchmarks.llm_load import Prompt, Send
from common import llm_protocol
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

FINAL = llm_protocol.FINAL_RESPONSE


def request(model: str, prompt: str, sampling: dict, stream: bool = True) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, id="bench")
    text = prompt.encode()
    params = json.dumps(sampling).encode()
    for name, datatype, raw in (
        (llm_protocol.TEXT_INPUT, "BYTES", struct.pack("<I", len(text)) + text),
        (llm_protocol.STREAM, "BOOL", bytes([stream])),
        (llm_protocol.SAMPLING_PARAMETERS, "BYTES", struct.pack("<I", len(params)) + params),
        (llm_protocol.EXCLUDE_INPUT_IN_OUTPUT, "BOOL", b"\x01"),
    ):
        req.inputs.add(name=name, datatype=datatype, shape=[1])
        req.raw_input_contents.append(raw)
    return req


def _param(p: pb.InferParameter) -> object:
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def text_of(response: pb.ModelInferResponse) -> str:
    """text_output of one response, from raw contents or typed contents; '' if absent."""
    for i, out in enumerate(response.outputs):
        if out.name != llm_protocol.TEXT_OUTPUT:
            continue
        if i < len(response.raw_output_contents):
            raw, items, offset = response.raw_output_contents[i], [], 0
            while offset + 4 <= len(raw):
                (n,) = struct.unpack_from("<I", raw, offset)
                items.append(raw[offset + 4 : offset + 4 + n])
                offset += 4 + n
            return b"".join(items).decode("utf-8", "replace")
        return b"".join(out.contents.bytes_contents).decode("utf-8", "replace")
    return ""


def triton_sender(
    address: str, model: str, sampling: dict | None = None, timeout_s: float = 300.0
) -> tuple[Send, grpc.aio.Channel]:
    """A Send over one shared channel (close it when done); each request is its own
    ModelStreamInfer call carrying one request."""
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    async def send(prompt: Prompt, max_tokens: int) -> AsyncIterator[tuple[str, dict]]:
        req = request(
            model, prompt.text, {"max_tokens": max_tokens, "temperature": 0, **(sampling or {})}
        )
        call = stub.ModelStreamInfer(iter([req]), timeout=timeout_s)
        try:
            async for reply in call:
                if reply.error_message:
                    raise RuntimeError(reply.error_message)
                params = {k: _param(v) for k, v in reply.infer_response.parameters.items()}
                yield text_of(reply.infer_response), params
                if params.get(FINAL):
                    return
        finally:
            call.cancel()

    return send, channel
