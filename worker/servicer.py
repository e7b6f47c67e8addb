"""inference.GRPCInferenceService on the worker: decode -> batcher -> encode.

Thin on purpose: validation lives in codec, scheduling in batcher, sessions in runtime.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from common import model_keys, rpc
from common.errors import InvalidArgument, MeshError, grpc_errors
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from worker import codec, streaming
from worker.repository import LoadedModel, Repository
from worker.roofline import PREFIX as ROOFLINE
from worker.roofline import Roofs
from worker.stats import Duration

log = structlog.get_logger()

SERVER_NAME = "meshserve-worker"
VERSION = "0.1.0"
EXTENSIONS = ["model_configuration", "schedule_policy", "statistics"]


class WorkerServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        repository: Repository,
        limits: codec.Limits | None = None,
        roofs: Roofs | None = None,
    ) -> None:
        self.repository = repository
        self.limits = limits or codec.Limits()
        self.roofs = roofs or Roofs()
        self.ready = False  # set once every model is loaded and warm; cleared on drain
        # Told of every request as it starts (the registration publishes the depth change
        # at once instead of polling an idle worker for it).
        self.on_request: Callable[[], None] = lambda: None

    @grpc_errors
    async def ServerLive(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ServerLiveResponse(live=True)

    @grpc_errors
    async def ServerReady(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ServerReadyResponse(ready=self.ready)

    @grpc_errors
    async def ModelReady(self, request, context):  # type: ignore[no-untyped-def]
        try:
            self.repository.get(request.name, request.version)
        except MeshError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.ready)

    @grpc_errors
    async def ServerMetadata(self, request, context):  # type: ignore[no-untyped-def]
        providers = [f"execution_provider/{p}" for p in sorted(self.repository.providers)]
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=VERSION, extensions=EXTENSIONS + providers
        )

    @grpc_errors
    async def ModelMetadata(self, request, context):  # type: ignore[no-untyped-def]
        model = self.repository.get(request.name, request.version)
        spec = model.spec
        batch = [-1] if spec.max_batch_size > 0 else []
        response = pb.ModelMetadataResponse(
            name=spec.name,
            versions=sorted(self.repository.models[spec.name], key=int),
            platform=model.config.platform,
        )
        # Every input, optional ones too, as Triton lists them: perf_analyzer and genai-perf
        # look up each input of ModelConfig here, and skip the ones ModelConfig marks
        # `optional: true` when they make data.
        for t in spec.inputs.values():
            response.inputs.add(name=t.name, datatype=t.datatype, shape=batch + list(t.dims))
        for t in spec.outputs.values():
            response.outputs.add(name=t.name, datatype=t.datatype, shape=batch + list(t.dims))
        return response

    @grpc_errors
    async def ModelConfig(self, request, context):  # type: ignore[no-untyped-def]
        model = self.repository.get(request.name, request.version)
        return pb.ModelConfigResponse(config=model.config)

    @grpc_errors
    async def ModelInfer(self, request, context):  # type: ignore[no-untyped-def]
        return await self._infer(request)

    async def _infer(
        self, request: pb.ModelInferRequest | codec.Unparsable
    ) -> pb.ModelInferResponse:
        """The one response of a call (an LLM's whole text, streamed or not)."""
        responses = [r async for r in self._responses(request, stream=False)]
        return responses[-1]

    async def _responses(
        self, request: pb.ModelInferRequest | codec.Unparsable, stream: bool
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """Every response to one request, from its model's backend; the request's
        bookkeeping (log context, depth wake-up, statistics) in one place for both RPCs."""
        if isinstance(request, codec.Unparsable):
            raise InvalidArgument(f"the request is not a valid ModelInferRequest ({request.error})")
        structlog.contextvars.bind_contextvars(request_id=request.id, model=request.model_name)
        model = self.repository.get(request.model_name, request.model_version)
        self.on_request()
        start = time.perf_counter_ns()
        ok = False
        try:
            async for response in model.backend.responses(request, self.limits, stream):
                yield response
            ok = True
        finally:
            model.stats.record_request(ok, time.perf_counter_ns() - start)

    def _stream(
        self, request: pb.ModelInferRequest | codec.Unparsable
    ) -> AsyncIterator[pb.ModelInferResponse]:
        """Every response of one request on a stream: one for a plain model; for an LLM
        with stream=true, one per new piece of text, the last flagged final."""
        return self._responses(request, stream=True)

    async def ModelStreamInfer(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context
    ) -> None:
        """Requests on one stream run concurrently; responses go back as they come."""
        await streaming.serve(request_iterator, self._stream, context.write, streams=True)

    @grpc_errors
    async def ModelStatistics(self, request, context):  # type: ignore[no-untyped-def]
        if request.name:
            if request.version:
                models = [self.repository.get(request.name, request.version)]
            else:
                self.repository.get(request.name)
                models = list(self.repository.models[request.name].values())
        else:
            models = self.repository.all()
        # The first call reads each model's ONNX graph for its analysis: off the event loop.
        figures = await asyncio.to_thread(lambda: [self.roofline(m) for m in models])
        return pb.ModelStatisticsResponse(
            model_stats=[_statistics(m, f) for m, f in zip(models, figures, strict=True)]
        )

    def roofline(self, model: LoadedModel) -> dict[str, float]:
        """Achieved FLOP/s and bytes/s of `model` and their fractions of the roof
        (worker/roofline.py); what a metrics endpoint reports."""
        spec = model.spec
        return self.roofs.figures(model.session.path, spec.name, spec.version, model.stats)

    @grpc_errors
    async def RepositoryIndex(self, request, context):  # type: ignore[no-untyped-def]
        response = pb.RepositoryIndexResponse()
        for model in self.repository.all():
            response.models.add(name=model.spec.name, version=model.spec.version, state="READY")
        return response


def handler(servicer: WorkerServicer) -> grpc.GenericRpcHandler:
    """The inference service with ModelInfer's requests parsed by `codec.parse_request`, so a
    request that is not a ModelInferRequest gets INVALID_ARGUMENT rather than gRPC's UNKNOWN."""
    return rpc.inference_handler(
        servicer,
        grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfer,
            request_deserializer=codec.parse_request,
            response_serializer=pb.ModelInferResponse.SerializeToString,
        ),
        grpc.stream_stream_rpc_method_handler(
            servicer.ModelStreamInfer,
            request_deserializer=codec.parse_request,
            response_serializer=pb.ModelStreamInferResponse.SerializeToString,
        ),
    )


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


def _roofline_usage(figures: dict[str, float]) -> list[pb.MemoryUsage]:
    """Triton's ModelStatistics has no parameters map, so the roofline figures travel as
    MemoryUsage entries, integers: `meshserve.roofline.<figure>` with the value in
    byte_size (fractions in parts per million: `..._ppm`)."""
    out = []
    for key, value in sorted(figures.items()):
        if key.endswith("_fraction"):
            key, value = f"{key}_ppm", value * 1e6
        out.append(pb.MemoryUsage(type=ROOFLINE + key, byte_size=max(0, round(value))))
    return out


SPECULATIVE = model_keys.SPECULATIVE


def _speculative_usage(model: LoadedModel) -> list[pb.MemoryUsage]:
    """An LLM engine's draft tokens, as the roofline figures travel: proposed_tokens,
    accepted_tokens and acceptance_ppm (parts per million); none without a draft model."""
    engine = model.llm.engine if model.llm is not None else None
    if engine is None or engine.drafter is None:
        return []
    s = engine.stats
    figures = {
        "proposed_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_ppm": round(s.acceptance_rate * 1e6),
    }
    return [pb.MemoryUsage(type=SPECULATIVE + k, byte_size=v) for k, v in figures.items()]


def _statistics(model: LoadedModel, figures: dict[str, float]) -> pb.ModelStatistics:
    s = model.stats
    return pb.ModelStatistics(
        name=model.spec.name,
        version=model.spec.version,
        last_inference=s.last_inference_ms,
        inference_count=s.inference_count,
        execution_count=s.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(s.success),
            fail=_duration(s.fail),
            queue=_duration(s.queue),
            compute_input=_duration(s.compute_input),
            compute_infer=_duration(s.compute_infer),
            compute_output=_duration(s.compute_output),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size,
                compute_input=_duration(b.compute_input),
                compute_infer=_duration(b.compute_infer),
                compute_output=_duration(b.compute_output),
            )
            for size, b in sorted(s.batches.items())
        ],
        memory_usage=_roofline_usage(figures) + _speculative_usage(model),
    )
