"""One seam per model kind: what the servicer asks of a loaded model, whatever runs it.

    BatchedBackend   an ONNX model behind the dynamic batcher (a single session, or a shard
                     group's forward over its ranks)
    TextBackend      the same, with text in and the tokenizer's ids fed to the batcher
    LLMBackend       the generation engine (a single session's step graph, or a shard
                     group's): a decoupled model, many responses per request

Every backend answers a request as a stream (`responses`): a batched model yields one
response, an LLM one per piece of text when the client streams and one otherwise. ModelInfer
takes the one response of a non-streamed call; ModelStreamInfer sends all of them. So unary is
a stream of one, and a request is decoded once, wherever it arrives.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Protocol

from common import llm_protocol
from common.errors import MeshError
from protos import grpc_service_pb2 as pb
from worker import codec
from worker.batcher import Batcher
from worker.config import ModelSpec
from worker.llm.engine import Output
from worker.llm.serving import Completion, LLMServing
from worker.text import TextModel


class ModelBackend(Protocol):
    def responses(
        self, request: pb.ModelInferRequest, limits: codec.Limits, stream: bool
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """The responses to one request; `stream` False: the client wants exactly one."""
        ...

    @property
    def depth(self) -> int:
        """Requests waiting or running, as published to the routers."""
        ...

    @property
    def max_queue_size(self) -> int: ...

    @property
    def kv_tokens(self) -> tuple[int, int]:
        """(used, total) KV cache tokens; (0, 0) without a KV cache."""
        ...

    async def close(self) -> None: ...


class BatchedBackend:
    def __init__(self, spec: ModelSpec, batcher: Batcher) -> None:
        self.spec, self.batcher = spec, batcher

    async def infer(self, inputs: dict, outputs: list[str]) -> dict:
        return await self.batcher.submit(inputs, outputs)

    async def run(self, inputs: dict, outputs: list[str]) -> tuple[dict, int | None]:
        """The outputs, and the prompt tokens read where the model reads text (else None)."""
        return await self.infer(inputs, outputs), None

    async def responses(
        self, request: pb.ModelInferRequest, limits: codec.Limits, stream: bool
    ) -> AsyncIterator[pb.ModelInferResponse]:
        # A large request decodes (and its reply encodes) on a thread: pure-Python BYTES
        # work on the event loop would stall health checks and every other call.
        if codec.is_heavy(request):
            decoded = await asyncio.to_thread(codec.decode_request, request, self.spec, limits)
        else:
            decoded = codec.decode_request(request, self.spec, limits)
        results, tokens = await self.run(*decoded)
        if any(a.dtype == object and a.size > codec.HEAVY_ELEMENTS for a in results.values()):
            response = await asyncio.to_thread(codec.encode_response, request, self.spec, results)
        else:
            response = codec.encode_response(request, self.spec, results)
        if tokens is not None:
            response.parameters[llm_protocol.PROMPT_TOKENS].int64_param = tokens
        yield response

    @property
    def depth(self) -> int:
        return self.batcher.depth

    @property
    def max_queue_size(self) -> int:
        return self.batcher.max_queue_size

    @property
    def kv_tokens(self) -> tuple[int, int]:
        return 0, 0

    async def close(self) -> None:
        await self.batcher.close()


class TextBackend(BatchedBackend):
    def __init__(self, spec: ModelSpec, batcher: Batcher, text: TextModel) -> None:
        super().__init__(spec, batcher)
        self.text = text

    async def infer(self, inputs: dict, outputs: list[str]) -> dict:
        return await self.text.infer(inputs, outputs)

    async def run(self, inputs: dict, outputs: list[str]) -> tuple[dict, int | None]:
        return await self.text.infer_counted(inputs, outputs)


class LLMBackend:
    def __init__(self, spec: ModelSpec, serving: LLMServing) -> None:
        self.spec, self.serving = spec, serving

    async def responses(
        self, request: pb.ModelInferRequest, limits: codec.Limits, stream: bool
    ) -> AsyncIterator[pb.ModelInferResponse]:
        inputs, _ = codec.decode_request(request, self.spec, limits)
        parameters = codec.request_parameters(request)
        parsed = self.serving.parse(inputs, parameters)
        if not (stream and parsed.stream):
            # The whole text in one response; over ModelInfer too (Triton refuses a decoupled
            # model there; answering is what a unary client wants).
            yield self._answer(request, await self.serving.complete(parsed), parsed.params.n)
            return
        empty_final = parameters.get(llm_protocol.EMPTY_FINAL_RESPONSE) is True
        ids = parameters.get(llm_protocol.RETURN_TOKEN_IDS) is True
        async for out in self.serving.generate(parsed):
            _raise_failed(out)
            extra = _piece_parameters(out, parsed.params.n, ids)
            if not out.final:
                yield self._piece(request, out.text, False, out, extra)
            elif empty_final:
                if out.text:
                    yield self._piece(request, out.text, False, out, extra)
                    extra = {}  # the ids and logprobs went with the text
                yield self._piece(request, None, True, out, extra)
            else:
                yield self._piece(request, out.text, True, out, extra)

    def _piece(
        self,
        request: pb.ModelInferRequest,
        text: str | None,
        final: bool,
        out: Output,
        extra: dict[str, int | str] | None = None,
    ) -> pb.ModelInferResponse:
        return codec.encode_text_piece(
            request, self.spec, text, final, usage(out), extra, final or out.finished
        )

    def _answer(
        self, request: pb.ModelInferRequest, done: Completion, n: int
    ) -> pb.ModelInferResponse:
        """A unary answer: n > 1 choices as text_output [n], finish_reason comma-separated
        in choice order, logprobs a JSON list of n lists."""
        if done.errors:
            raise MeshError(
                f"generation failed after {done.completion_tokens} tokens: {done.errors[0]}"
            )
        extra: dict[str, int | str] = {}
        if done.logprobs is not None:
            lists = done.logprobs if n > 1 else done.logprobs[0]
            extra[llm_protocol.RESPONSE_LOGPROBS] = json.dumps(lists)
        use = (done.prompt_tokens, done.completion_tokens, ",".join(done.reasons))
        text = done.texts if n > 1 else done.texts[0]
        return codec.encode_text_piece(
            request, self.spec, text, True, (*use, done.cached_tokens), extra
        )

    @property
    def depth(self) -> int:
        return self.serving.engine.depth

    @property
    def max_queue_size(self) -> int:
        return self.serving.config.max_waiting + self.serving.config.max_num_seqs

    @property
    def kv_tokens(self) -> tuple[int, int]:
        kv = self.serving.engine.kv
        return kv.reserved_tokens, kv.budget_tokens

    async def close(self) -> None:
        await self.serving.engine.close()


def usage(out: Output) -> tuple[int, int, str, int]:
    return out.prompt_tokens, out.completion_tokens, out.finish_reason or "", out.cached_tokens


def _piece_parameters(out: Output, n: int, ids: bool) -> dict[str, int | str]:
    """A streamed piece's choice index (n > 1), its tokens' ids and logprobs (when asked
    for)."""
    extra: dict[str, int | str] = {}
    if ids:  # compact JSON: a few bytes a token
        extra[llm_protocol.TOKEN_IDS] = json.dumps(out.token_ids, separators=(",", ":"))
    if n > 1:
        extra[llm_protocol.INDEX] = out.index
    if out.logprobs is not None:
        extra[llm_protocol.RESPONSE_LOGPROBS] = json.dumps(out.logprobs)
    return extra


def _raise_failed(out: Output) -> None:
    if out.error is not None:
        raise MeshError(f"generation failed after {out.completion_tokens} tokens: {out.error}")
