"""The router's HTTP front door: OpenAI's API and KServe v2 REST (Triton's HTTP API) on one
port, served by the same dispatch path as gRPC (see calls.py). docs/http.md for users."""

from __future__ import annotations

from router.forwarding.dispatch import Dispatcher
from router.http.app import App
from router.http.calls import MeshCalls
from router.http.routes import Routes
from router.http.server import HttpServer
from router.servicer import RouterServicer
from router.tenancy.auth import Auth


def front_door(
    servicer: RouterServicer,
    dispatcher: Dispatcher,
    auth: Auth | None,
    max_body_bytes: int,
    body_timeout_s: float,
) -> App:
    return App(Routes(MeshCalls(servicer, dispatcher, auth)), max_body_bytes, body_timeout_s)


__all__ = ["App", "HttpServer", "front_door"]
