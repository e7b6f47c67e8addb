"""The mesh as both front doors call it, whatever the transport: who is calling
(`authenticate`), may they use a model (`authorize`, and `allows` for the lists), one
request dispatched (`infer`/`answer` for a unary call, `stream` for a stream: each request
admitted against its tenant's limits and the router's in-flight limits, routed, failed over
and billed by the dispatcher), and the metadata a tenant may see (server, repository index,
a model's readiness, metadata, config and statistics).

The gRPC servicer (router/servicer.py) and the HTTP front door (router/http/) only decode
their transport, call these and encode the answer. Errors are MeshErrors carrying their gRPC
code; each door turns them into its own status at one boundary. The metadata answers are
KServe v2's messages (protos/ is the contract; most are a worker's reply passed on).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
import structlog

from common.errors import MeshError, NotFound, Unauthenticated, UpstreamError, clip
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from router.forwarding.aggregate import sum_statistics
from router.forwarding.dispatch import Dispatcher
from router.forwarding.registry import Registry
from router.forwarding.replica import Replica
from router.forwarding.streams import Send, StreamForwarder
from router.money.accounting import Receipt
from router.tenancy.auth import Auth, Tenant

log = structlog.get_logger()

SERVER_NAME = "meshserve-router"
VERSION = "0.1.0"
UPSTREAM_TIMEOUT_S = 10.0
# How each transport carries the key, for the refusal of a call that sent none.
KEY_IN_METADATA = "the metadata 'authorization: Bearer <API key>'"
KEY_IN_HEADER = "the header 'Authorization: Bearer <API key>'"

Call = Callable[[pb_grpc.GRPCInferenceServiceStub], Awaitable[Any]]


class MeshApi:
    def __init__(self, registry: Registry, dispatcher: Dispatcher, auth: Auth | None) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self.auth = auth  # None: auth off (make run on 127.0.0.1)

    # -- who, and may they -----------------------------------------------------------------

    async def authenticate(
        self, authorization: str | bytes | None, sent_as: str = KEY_IN_METADATA
    ) -> Tenant | None:
        """The caller's tenant from its `authorization` value ('Bearer <key>'); None when
        auth is off. UNAUTHENTICATED without a valid key; `sent_as` says where it goes."""
        if self.auth is None:
            return None
        if authorization is None:
            raise Unauthenticated(
                f"no API key: send {sent_as} (keys: python -m router keys create --tenant T)"
            )
        return await self.auth.authenticate([("authorization", authorization)])

    @staticmethod
    def authorize(tenant: Tenant | None, model: str) -> None:
        """PERMISSION_DENIED for a model the tenant may not call (served or not)."""
        if tenant is not None:
            Auth.authorize(tenant, model)

    @staticmethod
    def allows(tenant: Tenant | None, model: str) -> bool:
        return tenant is None or tenant.policy.allows(model)

    # -- inference -------------------------------------------------------------------------

    async def infer(
        self, raw: bytes, deadline: float | None, tenant: Tenant | None
    ) -> tuple[bytes, Receipt | None]:
        """One ModelInferRequest's bytes -> the reply's bytes and, for a billed success, the
        receipt `settle` takes once the transport knows whether the reply reached its client
        (see Dispatcher.infer). `deadline`: time.monotonic()-based, None for none."""
        return await self.dispatcher.infer(raw, deadline, tenant)

    def settle(self, receipt: Receipt, delivered: bool) -> None:
        self.dispatcher.settle(receipt, delivered)

    async def answer(
        self, raw: bytes, tenant: Tenant | None, deliver: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """A unary call whose reply `deliver` sends; refunded when `deliver` raised."""
        reply, receipt = await self.infer(raw, None, tenant)
        try:
            await deliver(reply)
        except BaseException:
            if receipt is not None:
                self.settle(receipt, False)
            raise

    async def stream(
        self,
        requests: AsyncIterator[bytes],
        send: Send,
        deadline: float | None,
        tenant: Tenant | None,
    ) -> None:
        """Each request forwarded, every response handed to `send` as it comes (a response
        whose `send` fails is not billed, see router/forwarding/streams.py)."""
        await StreamForwarder(self.dispatcher, deadline, tenant).serve(requests, send)

    # -- health and metadata ---------------------------------------------------------------

    def ready(self) -> bool:
        return bool(_healthy(self.registry.replicas.values()))

    def server_metadata(self) -> pb.ServerMetadataResponse:
        providers = sorted(
            {f"execution_provider/{r.info.provider}" for r in self.registry.replicas.values()}
        )
        return pb.ServerMetadataResponse(
            name=SERVER_NAME,
            version=VERSION,
            extensions=["model_configuration", "statistics", *providers],
        )

    def repository_index(self, tenant: Tenant | None) -> pb.RepositoryIndexResponse:
        """Every (model, version) served that the tenant may use."""
        versions = {
            (name, v)
            for r in self.registry.replicas.values()
            for name, entry in r.info.models.items()
            for v in entry.versions
            if self.allows(tenant, name)
        }
        reply = pb.RepositoryIndexResponse()
        for name, version in sorted(versions):
            reply.models.add(name=name, version=version, state="READY")
        return reply

    async def model_ready(self, tenant: Tenant | None, name: str, version: str) -> bool:
        self.authorize(tenant, name)
        request = pb.ModelReadyRequest(name=name, version=version)
        for replica in _healthy(self.registry.replicas_for(name, version)):
            try:
                reply = await _stub(replica).ModelReady(request, timeout=UPSTREAM_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue
            if reply.ready:
                return True
        return False

    async def model_metadata(
        self, tenant: Tenant | None, name: str, version: str
    ) -> pb.ModelMetadataResponse:
        self.authorize(tenant, name)
        request = pb.ModelMetadataRequest(name=name, version=version)
        return await self._forward(
            lambda stub: stub.ModelMetadata(request, timeout=UPSTREAM_TIMEOUT_S), name, version
        )

    async def model_config(
        self, tenant: Tenant | None, name: str, version: str
    ) -> pb.ModelConfigResponse:
        """The model's config as the tenant may see it (prices only for an admin)."""
        self.authorize(tenant, name)
        request = pb.ModelConfigRequest(name=name, version=version)
        reply = await self._forward(
            lambda stub: stub.ModelConfig(request, timeout=UPSTREAM_TIMEOUT_S), name, version
        )
        return Auth.visible_config(tenant, reply)

    async def statistics(
        self, tenant: Tenant | None, name: str, version: str
    ) -> pb.ModelStatisticsResponse:
        """One model's statistics summed over its replicas; every model's ("" name) that the
        tenant may use."""
        if name:
            self.authorize(tenant, name)
            replicas = self.registry.replicas_for(name, version)
            if not replicas:
                raise NotFound(f"no replica serves model {clip(name)}")
        else:
            replicas = list(self.registry.replicas.values())
        request = pb.ModelStatisticsRequest(name=name, version=version)
        replies = await asyncio.gather(
            *(_stub(r).ModelStatistics(request, timeout=UPSTREAM_TIMEOUT_S) for r in replicas),
            return_exceptions=True,
        )
        for replica, reply in zip(replicas, replies, strict=True):
            if isinstance(reply, BaseException):  # its figures are missing from the sum: say so
                log.warning("statistics_failed", worker=replica.info.id, error=str(reply))
        summed = sum_statistics([r for r in replies if isinstance(r, pb.ModelStatisticsResponse)])
        if tenant is not None and not name:
            kept = [s for s in summed.model_stats if self.allows(tenant, s.name)]
            del summed.model_stats[:]
            summed.model_stats.extend(kept)
        return summed

    async def _forward(self, call: Call, model: str, version: str) -> Any:
        """`call`'s answer from the first healthy replica; the next one after UNAVAILABLE."""
        replicas = _healthy(self.registry.replicas_for(model, version))
        if not replicas:
            what = f"model {clip(model)}" + (f" version {clip(version)}" if version else "")
            raise NotFound(f"no replica serves {what}")
        last: grpc.aio.AioRpcError | None = None
        for replica in replicas:
            try:
                return await call(_stub(replica))
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _upstream(e) from None
                last = e
        assert last is not None
        raise _upstream(last)


def _healthy(replicas: Iterable[Replica]) -> list[Replica]:
    return [r for r in replicas if not r.ejected]


def _upstream(e: grpc.aio.AioRpcError) -> MeshError:
    return UpstreamError(e.code(), e.details() or e.code().name)


def _stub(replica: Replica) -> pb_grpc.GRPCInferenceServiceStub:
    return pb_grpc.GRPCInferenceServiceStub(replica.channel)
