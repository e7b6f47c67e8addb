"""Exceptions that carry their gRPC status code.

Code below the servicers raises these; `grpc_errors` turns them into `context.abort` at the
servicer boundary, so every RPC maps errors the same way. Anything else is a bug: INTERNAL.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

log = structlog.get_logger()


class MeshError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.trailers = trailers  # trailing metadata sent with the status (retry-after)


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(MeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(MeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class FailedPrecondition(MeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Internal(MeshError):
    """A failure that is ours or the model's, not the client's: INTERNAL, logged where raised."""

    code = grpc.StatusCode.INTERNAL


class UpstreamError(MeshError):
    """A status from a server this one called (the router's workers), passed on unchanged."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


R = TypeVar("R")


def grpc_errors(
    method: Callable[..., Awaitable[R]],
) -> Callable[..., Awaitable[R]]:
    """Wrap a unary servicer method: MeshError -> its status, anything else -> INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except MeshError as e:
            await context.abort(e.code, e.message, e.trailers)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            log.exception("internal_error", rpc=method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable")  # context.abort always raises

    return wrapper


def clip(text: str, limit: int = 64) -> str:
    """A client-chosen string as it may appear in an error message: at most `limit` chars
    (a 10 KB model name must not push the status past gRPC's metadata limit), repr-quoted."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"
