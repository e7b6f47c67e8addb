"""Client and AsyncClient: one gRPC channel to a KServe v2 endpoint.

Failed calls raise `grpc.RpcError` (`.code()` is the status: NOT_FOUND, INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, UNAVAILABLE, ...). Every call has a deadline: `timeout` per call, or the
client's default.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import codec
from client.codec import InferResult, InputValue, ModelMetadata, ServerMetadata
from common import health, tls
from common.rpc import MAX_MESSAGE_BYTES, message_options
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc


class Client:
    """Blocking client. `with Client("host:port") as c: c.infer(...)`."""

    def __init__(
        self,
        address: str,
        timeout: float = 30.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
    ) -> None:
        """`credentials`: TLS (common.tls.channel_credentials); `api_key`: sent with every
        call as `authorization: Bearer <key>` (the router's tenants)."""
        self.address = address
        self.timeout = timeout
        self.channel = tls.channel(address, credentials, message_options(max_message_bytes))
        if api_key:
            self.channel = grpc.intercept_channel(self.channel, _Bearer(api_key))
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self._metadata: dict[tuple[str, str], ModelMetadata] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def server_live(self, timeout: float | None = None) -> bool:
        reply = self.stub.ServerLive(pb.ServerLiveRequest(), timeout=timeout or self.timeout)
        return bool(reply.live)

    def server_ready(self, timeout: float | None = None) -> bool:
        reply = self.stub.ServerReady(pb.ServerReadyRequest(), timeout=timeout or self.timeout)
        return bool(reply.ready)

    def model_ready(self, model: str, version: str = "", timeout: float | None = None) -> bool:
        request = pb.ModelReadyRequest(name=model, version=version)
        return bool(self.stub.ModelReady(request, timeout=timeout or self.timeout).ready)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """grpc.health.v1 status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN."""
        return health.check(self.channel, service, timeout or self.timeout)

    def server_metadata(self, timeout: float | None = None) -> ServerMetadata:
        reply = self.stub.ServerMetadata(
            pb.ServerMetadataRequest(), timeout=timeout or self.timeout
        )
        return codec.server_metadata(reply)

    def model_metadata(
        self, model: str, version: str = "", timeout: float | None = None
    ) -> ModelMetadata:
        key = (model, version)
        if key not in self._metadata:
            request = pb.ModelMetadataRequest(name=model, version=version)
            reply = self.stub.ModelMetadata(request, timeout=timeout or self.timeout)
            config = self.stub.ModelConfig(
                pb.ModelConfigRequest(name=model, version=version), timeout=timeout or self.timeout
            )
            self._metadata[key] = codec.model_metadata(reply, config)
        return self._metadata[key]

    def infer(
        self,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Sequence[str] = (),
        version: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> InferResult:
        request = codec.infer_request(model, inputs, outputs, version, request_id)
        return codec.infer_result(self.stub.ModelInfer(request, timeout=timeout or self.timeout))

    def infer_text(
        self, model: str, text: str | Sequence[str], version: str = "", timeout: float | None = None
    ) -> list[str]:
        """For a model with one BYTES input and one BYTES output: strings in, strings out."""
        meta = self.model_metadata(model, version, timeout)
        inputs, output = codec.text_inputs(meta, text)
        return self.infer(model, inputs, [output], version, timeout=timeout).text(output)


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the API key to every call's metadata."""

    def __init__(self, key: str) -> None:
        self.metadata = ("authorization", f"Bearer {key}")

    def _with_key(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self.metadata],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class AsyncClient:
    """The same calls on grpc.aio: `async with AsyncClient(address) as c: await c.infer(...)`."""

    def __init__(
        self, address: str, timeout: float = 30.0, max_message_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = grpc.aio.insecure_channel(
            address, options=message_options(max_message_bytes)
        )
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def server_ready(self, timeout: float | None = None) -> bool:
        reply = await self.stub.ServerReady(
            pb.ServerReadyRequest(), timeout=timeout or self.timeout
        )
        return bool(reply.ready)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        reply = await self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout or self.timeout
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def model_metadata(
        self, model: str, version: str = "", timeout: float | None = None
    ) -> ModelMetadata:
        request = pb.ModelMetadataRequest(name=model, version=version)
        reply = await self.stub.ModelMetadata(request, timeout=timeout or self.timeout)
        config = await self.stub.ModelConfig(
            pb.ModelConfigRequest(name=model, version=version), timeout=timeout or self.timeout
        )
        return codec.model_metadata(reply, config)

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, InputValue],
        outputs: Sequence[str] = (),
        version: str = "",
        request_id: str = "",
        timeout: float | None = None,
    ) -> InferResult:
        request = codec.infer_request(model, inputs, outputs, version, request_id)
        reply = await self.stub.ModelInfer(request, timeout=timeout or self.timeout)
        return codec.infer_result(reply)
