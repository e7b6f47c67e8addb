"""Fakes the router's unit tests share."""

from __future__ import annotations

from typing import Any


class FakeChannel:
    """A replica's channel that is never called: the tests pick, they do not forward."""

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return None

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return None
