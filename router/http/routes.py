"""The endpoints: OpenAI's /v1 and KServe v2's (Triton's) /v2, each a thin handler over
the mesh API (router/mesh.py, through calls.py for a call) and a codec (openai.py,
tensors.py, pbjson.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from common.errors import MeshError
from protos import grpc_service_pb2 as pb
from router.http import answers, openai, protocol, responses, tensors
from router.http.app import Handler, Out, Request
from router.http.calls import MeshCalls
from router.http.errors import HttpError
from router.http.model_names import EMBED, LLM, ModelNames
from router.http.pbjson import to_json
from router.mesh import MeshApi
from router.tenancy.auth import Tenant

log = structlog.get_logger()

JSON = "application/json"
OPENAI_ROOTS = ("chat", "completions", "embeddings", "responses", "models")


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


@contextlib.contextmanager
def _naming(param: str | None) -> Iterator[None]:
    """A model's refusal of what the request carried (token ids to a model that takes
    text, say) as a 400 naming the field that carried it."""
    try:
        yield
    except MeshError as e:
        if param is None or e.code != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        raise HttpError(400, f"{param}: {e.message}", param) from None


class Routes:
    def __init__(self, mesh: MeshApi, aliases: dict[str, str] | None = None) -> None:
        self.mesh = mesh
        self.calls = MeshCalls(mesh)
        self.names = ModelNames(mesh, aliases or {})

    def __call__(self, request: Request) -> Handler | None:
        method, parts = request.method, [p for p in request.path.split("/") if p]
        if parts[:1] == ["v1"]:
            return self._openai(method, parts[1:])
        if parts[:1] == ["v2"]:
            return self._kserve(method, parts[1:])
        if parts[:1] and parts[0] in OPENAI_ROOTS:  # llama-server's routes without /v1
            return self._openai(method, parts)
        if method == "GET" and parts == ["health"]:  # vLLM's and llama-server's probe
            return self.health
        return None

    async def _body(self, request: Request, kind: str, tenant: Tenant | None) -> Any:
        """The JSON body with its `model` resolved to a served name (model_names.py)."""
        doc = tensors.parse_json(request.body)
        await self.names.resolve(doc, kind, tenant)
        return doc

    async def _caller(self, request: Request) -> Tenant | None:
        """The caller's tenant from its Authorization header (None: auth off)."""
        return await self.calls.tenant(request.header("authorization"))

    # -- routing -------------------------------------------------------------------------------

    def _openai(self, method: str, parts: list[str]) -> Handler | None:
        if method == "POST" and parts == ["chat", "completions"]:
            return self.chat
        if method == "POST" and parts == ["completions"]:
            return self.completion
        if method == "POST" and parts == ["embeddings"]:
            return self.embeddings
        if method == "POST" and parts == ["responses"]:
            return self.responses
        if method == "GET" and parts[:1] == ["models"] and len(parts) <= 2:
            return self.models
        return None

    def _kserve(self, method: str, parts: list[str]) -> Handler | None:
        if method == "GET" and parts in ([], ["health", "live"], ["health", "ready"]):
            return self.server
        if method == "POST" and parts == ["repository", "index"]:
            return self.repository_index
        if parts == ["models", "stats"] and method == "GET":
            return self.stats
        if parts[:1] != ["models"] or len(parts) < 2:
            return None
        rest = parts[2:]
        if rest[:1] == ["versions"]:
            rest = rest[2:]
        if method == "GET" and rest in ([], ["ready"], ["config"], ["stats"]):
            return {"": self.metadata, "ready": self.ready, "config": self.config}.get(
                rest[0] if rest else "", self.stats
            )
        if method == "POST" and rest == ["infer"]:
            return self.infer
        if method == "POST" and rest in (["generate"], ["generate_stream"]):
            return self.generate
        return None

    # -- OpenAI --------------------------------------------------------------------------------

    async def chat(self, request: Request, out: Out) -> None:
        await self._openai_call(request, out, protocol.ChatRequest, openai.chat)

    async def completion(self, request: Request, out: Out) -> None:
        await self._openai_call(request, out, protocol.CompletionRequest, openai.completion)

    async def _openai_call(self, request: Request, out: Out, model: Any, build: Any) -> None:
        tenant = await self._caller(request)
        g = build(protocol.parse(model, await self._body(request, LLM, tenant)))
        rid = answers.new_id(g.chat)
        if not g.stream:

            async def answer(reply: pb.ModelInferResponse) -> None:
                await out.respond(200, _json(answers.answer(g, rid, reply)))

            with _naming("prompt" if g.prompt_ids is not None else None):
                await self.calls.infer_answered(openai.worker_request(g, rid), tenant, answer)
            return
        chunks = answers.Chunks(g, rid)
        await self._events(out, openai.worker_request(g, rid), tenant, chunks.first, chunks.events)

    async def responses(self, request: Request, out: Out) -> None:
        tenant = await self._caller(request)
        doc = await self._body(request, LLM, tenant)
        g = responses.generation(protocol.parse(responses.ResponsesRequest, doc))
        raw = openai.worker_request(g, "resp")
        if not g.stream:

            async def answer(reply: pb.ModelInferResponse) -> None:
                await out.respond(200, _json(responses.Response(g).whole(reply)))

            await self.calls.infer_answered(raw, tenant, answer)
            return
        events = responses.Events(g)
        await self._events(out, raw, tenant, events.start, events.events)

    async def _events(
        self,
        out: Out,
        raw: bytes,
        tenant: Any,
        first: Callable[[], bytes],
        events: Callable[[pb.ModelInferResponse], bytes],
    ) -> None:
        """A streamed call as server-sent events: `first` once the stream starts, then the
        events each worker response makes."""

        async def piece(response: pb.ModelStreamInferResponse) -> None:
            if response.error_message:
                await self._stream_error(out, response)
                return
            if not out.started:
                await out.start_events()
                opening = first()
                if opening:
                    await out.event(opening)
            await out.event(events(response.infer_response))

        await self.calls.stream(raw, tenant, piece)
        await out.end_events()

    @staticmethod
    async def _stream_error(out: Out, response: pb.ModelStreamInferResponse) -> None:
        """A stream's error: its HTTP status when nothing was sent yet, else a last event."""
        error = HttpError.of_stream(response.error_message)
        retry = response.infer_response.parameters.get("retry-after")
        if retry is not None and retry.string_param:
            error.headers = HttpError.of_retry(retry.string_param)
        if not out.started:
            await out.respond(error.status, error.openai(), headers=error.headers)
            return
        await out.event(answers.error_event(error))

    async def embeddings(self, request: Request, out: Out) -> None:
        tenant = await self._caller(request)
        e = protocol.parse(protocol.EmbeddingRequest, await self._body(request, EMBED, tenant))

        async def answer(reply: pb.ModelInferResponse) -> None:
            await out.respond(200, _json(openai.embedding_answer(e, reply)))

        raw = openai.embedding_request(e, "embd")
        with _naming("input" if e.texts() is None else None):
            await self.calls.infer_answered(raw, tenant, answer)

    async def health(self, request: Request, out: Out) -> None:
        await out.respond(200 if self.mesh.ready() else 503, b"{}")

    async def models(self, request: Request, out: Out) -> None:
        index = self.mesh.repository_index(await self._caller(request))
        names = sorted({m.name for m in index.models})
        cards = [{"id": n, "object": "model", "created": 0, "owned_by": "meshserve"} for n in names]
        parts = [p for p in request.path.split("/") if p]
        wanted = parts[2:] if parts[:1] == ["v1"] else parts[1:]
        if wanted:
            card = next((c for c in cards if c["id"] == wanted[0]), None)
            if card is None:
                raise HttpError(404, f"model {wanted[0][:64]!r} is not served", "model")
            await out.respond(200, _json(card))
            return
        await out.respond(200, _json({"object": "list", "data": cards}))

    # -- KServe v2 -----------------------------------------------------------------------------

    @staticmethod
    def _model(request: Request) -> tuple[str, str]:
        parts = [p for p in request.path.split("/") if p]
        version = parts[4] if len(parts) > 4 and parts[3] == "versions" else ""
        return parts[2], version

    async def server(self, request: Request, out: Out) -> None:
        if request.path.rstrip("/") == "/v2":
            await self._caller(request)
            await out.respond(200, _json(to_json(self.mesh.server_metadata())))
            return
        if request.path.endswith("live"):
            await out.respond(200, b"")
            return
        await out.respond(200 if self.mesh.ready() else 503, b"")

    async def metadata(self, request: Request, out: Out) -> None:
        name, version = self._model(request)
        reply = await self.mesh.model_metadata(await self._caller(request), name, version)
        await out.respond(200, _json(to_json(reply)))

    async def ready(self, request: Request, out: Out) -> None:
        name, version = self._model(request)
        ready = await self.mesh.model_ready(await self._caller(request), name, version)
        await out.respond(200 if ready else 503, b"")

    async def config(self, request: Request, out: Out) -> None:
        name, version = self._model(request)
        reply = await self.mesh.model_config(await self._caller(request), name, version)
        await out.respond(200, _json(to_json(reply.config)))

    async def stats(self, request: Request, out: Out) -> None:
        name, version = (
            ("", "") if request.path.rstrip("/") == "/v2/models/stats" else self._model(request)
        )
        reply = await self.mesh.statistics(await self._caller(request), name, version)
        await out.respond(200, _json(to_json(reply)))

    async def repository_index(self, request: Request, out: Out) -> None:
        reply = self.mesh.repository_index(await self._caller(request))
        models = [to_json(m) for m in reply.models]
        await out.respond(200, _json(models))

    async def infer(self, request: Request, out: Out) -> None:
        tenant = await self._caller(request)
        name, version = self._model(request)
        doc, binary = tensors.split_body(request.body, request.header(tensors.HEADER_LENGTH))
        message = tensors.infer_request(doc, binary, name, version)
        every, named = tensors.wants_binary(doc)

        async def answer(reply: pb.ModelInferResponse) -> None:
            body, header_length = tensors.infer_response(reply, every, named)
            if header_length is None:
                await out.respond(200, body)
            else:
                await out.respond(
                    200,
                    body,
                    "application/octet-stream",
                    ((tensors.HEADER_LENGTH, str(header_length)),),
                )

        await self.calls.infer_answered(message.SerializeToString(), tenant, answer)

    async def generate(self, request: Request, out: Out) -> None:
        """Triton's generate extension: the body's keys are the model's inputs (one value
        each), `parameters` the request's; generate_stream answers server-sent events."""
        tenant = await self._caller(request)
        name, version = self._model(request)
        streamed = request.path.rstrip("/").endswith("generate_stream")
        message = tensors.generate_request(
            tensors.parse_json(request.body), name, version, streamed
        )
        raw = message.SerializeToString()
        if not streamed:

            async def answer(reply: pb.ModelInferResponse) -> None:
                await out.respond(200, _json(tensors.generate_response(reply)))

            await self.calls.infer_answered(raw, tenant, answer)
            return

        async def piece(response: pb.ModelStreamInferResponse) -> None:
            if response.error_message:
                error = HttpError.of_stream(response.error_message)
                if not out.started:
                    await out.respond(error.status, error.kserve(), headers=error.headers)
                else:
                    await out.event(b"data: " + error.kserve() + b"\n\n")
                return
            if not out.started:
                await out.start_events()
            doc = tensors.generate_response(response.infer_response)
            await out.event(b"data: " + _json(doc) + b"\n\n")

        await self.calls.stream(raw, tenant, piece)
        await out.end_events()
