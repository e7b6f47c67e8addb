"""The router's HTTP front door: OpenAI's API and KServe v2 REST (Triton's HTTP API) on one
port, calling the same mesh API as gRPC (router/mesh.py): the same keys, limits, dispatch
path, accounting and tenant view, in this process (never the router's gRPC port).
docs/http.md for users."""

from __future__ import annotations

from router.http.app import App
from router.http.routes import Routes
from router.http.server import HttpServer
from router.mesh import MeshApi


def front_door(
    mesh: MeshApi,
    max_body_bytes: int,
    body_timeout_s: float,
    model_aliases: dict[str, str] | None = None,
) -> App:
    return App(Routes(mesh, model_aliases), max_body_bytes, body_timeout_s)


__all__ = ["App", "HttpServer", "front_door"]
