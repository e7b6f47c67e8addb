"""Network helpers shared by the launcher, the TP group, benchmarks and tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS had free a moment ago (the usual race applies: bind it soon)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
