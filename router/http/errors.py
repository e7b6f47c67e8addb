"""HTTP errors: one exception with its status, and the mesh's gRPC codes mapped onto it.

Two bodies, one per API: OpenAI's `{"error": {"message", "type", "param", "code"}}` on
/v1/..., KServe v2's `{"error": "<message>"}` on /v2/... . A refusal over a limit keeps its
`retry-after` (router/tenancy/limits.py puts it in the gRPC trailers) as the Retry-After header.
"""

from __future__ import annotations

import json
import math

import grpc

from common.errors import MeshError

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's error types by status (what its SDK and clients read).
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    @classmethod
    def of(cls, error: MeshError) -> HttpError:
        status = STATUS.get(error.code, 500)
        headers = next((cls.of_retry(v) for k, v in error.trailers if k == "retry-after"), ())
        return cls(status, f"{error.code.name}: {error.message}", headers=headers)

    @staticmethod
    def of_retry(seconds: str) -> tuple[tuple[str, str], ...]:
        """Retry-After in whole seconds (HTTP's form), rounded up, from the limiter's."""
        try:
            return (("retry-after", str(max(1, math.ceil(float(seconds))))),)
        except ValueError:
            return ()

    @classmethod
    def of_stream(cls, message: str) -> HttpError:
        """A stream's error response, `error_message` "CODE: details"
        (router/forwarding/streams.py)."""
        name = message.split(":", 1)[0]
        code = getattr(grpc.StatusCode, name, None) if name.isupper() else None
        return cls(STATUS.get(code, 500) if code is not None else 500, message)

    def openai(self) -> bytes:
        kind = TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.status}
        return json.dumps({"error": body}).encode()

    def kserve(self) -> bytes:
        return json.dumps({"error": self.message}).encode()
