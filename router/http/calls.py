"""The HTTP front door's adapter to the mesh API (router/mesh.py): the key read from the
`Authorization` header, and a call's reply bytes decoded for the JSON codecs. Everything
else (keys, limits, routing, failover, accounting, billing, the tenant's view) is the mesh
API's, as for a gRPC call; nothing here calls the router's gRPC port.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from protos import grpc_service_pb2 as pb
from router.mesh import KEY_IN_HEADER, MeshApi
from router.tenancy.auth import Tenant

Piece = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]


class MeshCalls:
    def __init__(self, mesh: MeshApi) -> None:
        self.mesh = mesh

    async def tenant(self, authorization: str | None) -> Tenant | None:
        return await self.mesh.authenticate(authorization, KEY_IN_HEADER)

    async def infer_answered(
        self,
        raw: bytes,
        tenant: Tenant | None,
        answer: Callable[[pb.ModelInferResponse], Awaitable[None]],
    ) -> None:
        """A unary call answered by `answer`; refunded when the answer could not be sent."""

        async def deliver(reply: bytes) -> None:
            await answer(pb.ModelInferResponse.FromString(reply))

        await self.mesh.answer(raw, tenant, deliver)

    async def stream(self, raw: bytes, tenant: Tenant | None, on_piece: Piece) -> None:
        """One streamed request: every response handed to `on_piece` as it comes; a piece
        whose `on_piece` raises (the client is gone) is not billed, and the stream ends."""

        async def one() -> AsyncIterator[bytes]:
            yield raw

        async def send(data: bytes) -> None:
            await on_piece(pb.ModelStreamInferResponse.FromString(data))

        await self.mesh.stream(one(), send, None, tenant)
