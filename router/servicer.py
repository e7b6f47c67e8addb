"""inference.GRPCInferenceService on the router.

ModelInfer and ModelStreamInfer are registered with no (de)serializers: the handlers get the
requests' bytes and return the workers' reply bytes (see dispatch and streams). The other
methods are plain messages: aggregates over the registry, or forwarded to one replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from common import rpc
from common.errors import MeshError, NotFound, UpstreamError, clip, grpc_errors
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from router.forwarding.aggregate import sum_statistics
from router.forwarding.dispatch import Dispatcher
from router.forwarding.registry import Registry
from router.forwarding.replica import Replica
from router.forwarding.streams import StreamForwarder
from router.tenancy.auth import Auth, Tenant

log = structlog.get_logger()

SERVER_NAME = "meshserve-router"
VERSION = "0.1.0"
UPSTREAM_TIMEOUT_S = 10.0


class RouterServicer:
    def __init__(
        self, registry: Registry, dispatcher: Dispatcher, auth: Auth | None = None
    ) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self.auth = auth  # None: auth off (make run on 127.0.0.1)

    async def _tenant(self, context: Any, model: str | None = None) -> Tenant | None:
        """The caller's tenant (UNAUTHENTICATED without a valid key); with `model`, one it
        may use (PERMISSION_DENIED). None when auth is off."""
        if self.auth is None:
            return None
        tenant = await self.auth.authenticate(context.invocation_metadata())
        if model is not None:
            self.auth.authorize(tenant, model)
        return tenant

    def _allowed(self, tenant: Tenant | None, model: str) -> bool:
        return tenant is None or tenant.policy.allows(model)

    # -- inference -------------------------------------------------------------------------

    @grpc_errors
    async def ModelInfer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        tenant = await self._tenant(context)
        reply, receipt = await self.dispatcher.infer(request, _deadline(context), tenant)
        if receipt is not None:
            # Recorded as a success: if the client is gone by the time the reply is sent
            # (cancelled, or its deadline passed), the RPC ends cancelled and is refunded.
            context.add_done_callback(
                lambda ctx: self.dispatcher.settle(receipt, not ctx.cancelled())
            )
        return reply

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[bytes], context: Any) -> None:
        """Each request forwarded on a worker stream; every response written back as it
        comes (context.write: the forwarder settles billing by each write's outcome)."""
        try:
            tenant = await self._tenant(context)
        except MeshError as e:
            await context.abort(e.code, e.message)
        forwarder = StreamForwarder(self.dispatcher, _deadline(context), tenant)
        await forwarder.serve(request_iterator, context.write)

    # -- health and metadata ---------------------------------------------------------------

    @grpc_errors
    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @grpc_errors
    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=bool(self._healthy(self.registry.replicas.values())))

    @grpc_errors
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        await self._tenant(context)
        providers = sorted(
            {f"execution_provider/{r.info.provider}" for r in self.registry.replicas.values()}
        )
        return pb.ServerMetadataResponse(
            name=SERVER_NAME,
            version=VERSION,
            extensions=["model_configuration", "statistics", *providers],
        )

    @grpc_errors
    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        await self._tenant(context, request.name)
        for replica in self._healthy(self.registry.replicas_for(request.name, request.version)):
            try:
                reply = await _stub(replica).ModelReady(request, timeout=UPSTREAM_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue
            if reply.ready:
                return reply
        return pb.ModelReadyResponse(ready=False)

    @grpc_errors
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        await self._tenant(context, request.name)
        return await self._forward("ModelMetadata", request, request.name, request.version)

    @grpc_errors
    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        tenant = await self._tenant(context, request.name)
        reply = await self._forward("ModelConfig", request, request.name, request.version)
        return Auth.visible_config(tenant, reply)

    @grpc_errors
    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        tenant = await self._tenant(context)
        versions = {
            (name, v)
            for r in self.registry.replicas.values()
            for name, entry in r.info.models.items()
            for v in entry.versions
            if self._allowed(tenant, name)
        }
        reply = pb.RepositoryIndexResponse()
        for name, version in sorted(versions):
            reply.models.add(name=name, version=version, state="READY")
        return reply

    @grpc_errors
    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        tenant = await self._tenant(context, request.name or None)
        if request.name:
            replicas = self.registry.replicas_for(request.name, request.version)
            if not replicas:
                raise NotFound(f"no replica serves model {clip(request.name)}")
        else:
            replicas = list(self.registry.replicas.values())
        replies = await asyncio.gather(
            *(_stub(r).ModelStatistics(request, timeout=UPSTREAM_TIMEOUT_S) for r in replicas),
            return_exceptions=True,
        )
        for replica, reply in zip(replicas, replies, strict=True):
            if isinstance(reply, BaseException):  # its figures are missing from the sum: say so
                log.warning("statistics_failed", worker=replica.info.id, error=str(reply))
        summed = sum_statistics([r for r in replies if isinstance(r, pb.ModelStatisticsResponse)])
        if tenant is not None and not request.name:  # only the models the tenant may use
            kept = [s for s in summed.model_stats if self._allowed(tenant, s.name)]
            del summed.model_stats[:]
            summed.model_stats.extend(kept)
        return summed

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _healthy(replicas: Any) -> list[Replica]:
        return [r for r in replicas if not r.ejected]

    async def _forward(self, method: str, request: Any, model: str, version: str) -> Any:
        replicas = self._healthy(self.registry.replicas_for(model, version))
        if not replicas:
            what = f"model {clip(model)}" + (f" version {clip(version)}" if version else "")
            raise NotFound(f"no replica serves {what}")
        last: grpc.aio.AioRpcError | None = None
        for replica in replicas:
            try:
                return await getattr(_stub(replica), method)(request, timeout=UPSTREAM_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _upstream(e) from None
                last = e
        assert last is not None
        raise _upstream(last)


def _upstream(e: grpc.aio.AioRpcError) -> MeshError:
    return UpstreamError(e.code(), e.details() or e.code().name)


def _stub(replica: Replica) -> pb_grpc.GRPCInferenceServiceStub:
    return pb_grpc.GRPCInferenceServiceStub(replica.channel)


def _deadline(context: Any) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def handler(servicer: RouterServicer) -> grpc.GenericRpcHandler:
    """ModelInfer and ModelStreamInfer take and return bytes: forwarded untouched."""
    return rpc.inference_handler(
        servicer,
        grpc.unary_unary_rpc_method_handler(servicer.ModelInfer),
        grpc.stream_stream_rpc_method_handler(servicer.ModelStreamInfer),
    )
