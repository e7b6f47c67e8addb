"""The front door's one way into the mesh: the router's own dispatch path, in this process.

An HTTP call is authenticated with the same keys (`Authorization: Bearer <key>`), admitted
against the same limits, routed, failed over, accounted and billed by the same code as a
gRPC call: `Dispatcher.infer` for a unary call, `StreamForwarder` for a stream (its pieces
billed as they are written; one the client did not take is taken back). It never calls
the router's gRPC port. The metadata endpoints call the gRPC servicer's own methods, so a
tenant sees over HTTP exactly what it sees over gRPC.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.errors import MeshError, Unauthenticated
from protos import grpc_service_pb2 as pb
from router.forwarding.dispatch import Dispatcher
from router.forwarding.streams import StreamForwarder
from router.http.errors import HttpError
from router.servicer import RouterServicer
from router.tenancy.auth import Auth, Tenant

Piece = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]


class _Context:
    """What the servicer's methods read of a gRPC context, from an HTTP request."""

    def __init__(self, authorization: str | None) -> None:
        self.metadata = [("authorization", authorization)] if authorization else []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def time_remaining(self) -> None:
        return None

    async def abort(self, code: Any, message: str, trailers: tuple = ()) -> None:
        error = MeshError(message, tuple(trailers or ()))
        error.code = code
        raise HttpError.of(error)


class MeshCalls:
    def __init__(self, servicer: RouterServicer, dispatcher: Dispatcher, auth: Auth | None):
        self.servicer = servicer
        self.dispatcher = dispatcher
        self.auth = auth

    async def tenant(self, authorization: str | None) -> Tenant | None:
        if self.auth is None:
            return None
        if authorization is None:
            raise Unauthenticated(
                "no API key: send the header 'Authorization: Bearer <API key>' "
                "(keys: python -m router keys create --tenant T)"
            )
        return await self.auth.authenticate([("authorization", authorization)])

    def allowed(self, tenant: Tenant | None, model: str) -> bool:
        return tenant is None or tenant.policy.allows(model)

    @staticmethod
    async def grpc(
        method: Callable[[Any, Any], Awaitable[Any]], request: Any, authorization: str | None
    ) -> Any:
        """One of the servicer's methods (auth, tenant view and errors as over gRPC)."""
        return await method(request, _Context(authorization))

    async def infer_answered(
        self,
        raw: bytes,
        tenant: Tenant | None,
        answer: Callable[[pb.ModelInferResponse], Awaitable[None]],
    ) -> None:
        """A unary call answered by `answer`; refunded when the answer could not be sent."""
        reply, receipt = await self.dispatcher.infer(raw, None, tenant)
        try:
            await answer(pb.ModelInferResponse.FromString(reply))
        except BaseException:
            if receipt is not None:
                self.dispatcher.settle(receipt, False)
            raise

    async def stream(self, raw: bytes, tenant: Tenant | None, on_piece: Piece) -> None:
        """One streamed request: every response handed to `on_piece` as it comes; a piece
        whose `on_piece` raises (the client is gone) is not billed, and the stream ends."""

        async def one() -> AsyncIterator[bytes]:
            yield raw

        async def send(data: bytes) -> None:
            await on_piece(pb.ModelStreamInferResponse.FromString(data))

        await StreamForwarder(self.dispatcher, None, tenant).serve(one(), send)
