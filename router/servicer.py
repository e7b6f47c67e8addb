"""inference.GRPCInferenceService on the router: gRPC decoded, the mesh API (router/mesh.py)
called, its answer encoded.

ModelInfer and ModelStreamInfer are registered with no (de)serializers: the handlers get the
requests' bytes and return the workers' reply bytes (see dispatch and streams). The other
methods are plain messages.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from common import rpc
from common.errors import MeshError, grpc_errors
from protos import grpc_service_pb2 as pb
from router.mesh import MeshApi
from router.tenancy.auth import Tenant


class RouterServicer:
    def __init__(self, mesh: MeshApi) -> None:
        self.mesh = mesh

    async def _caller(self, context: Any) -> Tenant | None:
        return await self.mesh.authenticate(_authorization(context.invocation_metadata()))

    # -- inference -------------------------------------------------------------------------

    @grpc_errors
    async def ModelInfer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        tenant = await self._caller(context)
        reply, receipt = await self.mesh.infer(request, _deadline(context), tenant)
        if receipt is not None:
            # Recorded as a success: if the client is gone by the time the reply is sent
            # (cancelled, or its deadline passed), the RPC ends cancelled and is refunded.
            context.add_done_callback(lambda ctx: self.mesh.settle(receipt, not ctx.cancelled()))
        return reply

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[bytes], context: Any) -> None:
        """Each request forwarded on a worker stream; every response written back as it
        comes (context.write: the forwarder settles billing by each write's outcome)."""
        try:
            tenant = await self._caller(context)
        except MeshError as e:
            await context.abort(e.code, e.message)
        await self.mesh.stream(request_iterator, context.write, _deadline(context), tenant)

    # -- health and metadata ---------------------------------------------------------------

    @grpc_errors
    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @grpc_errors
    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.mesh.ready())

    @grpc_errors
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        await self._caller(context)
        return self.mesh.server_metadata()

    @grpc_errors
    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        tenant = await self._caller(context)
        ready = await self.mesh.model_ready(tenant, request.name, request.version)
        return pb.ModelReadyResponse(ready=ready)

    @grpc_errors
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        tenant = await self._caller(context)
        return await self.mesh.model_metadata(tenant, request.name, request.version)

    @grpc_errors
    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        tenant = await self._caller(context)
        return await self.mesh.model_config(tenant, request.name, request.version)

    @grpc_errors
    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        return self.mesh.repository_index(await self._caller(context))

    @grpc_errors
    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        tenant = await self._caller(context)
        return await self.mesh.statistics(tenant, request.name, request.version)


def _authorization(metadata: Any) -> str | bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value  # type: ignore[no-any-return]
    return None


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
