"""A dependency (Redis) that may go away: its state, logged when it changes, not per failure."""

from __future__ import annotations

from typing import Any

import structlog

log = structlog.get_logger()


class Outage:
    def __init__(self, down_event: str, up_event: str, **context: Any) -> None:
        self.down_event = down_event
        self.up_event = up_event
        self.context = context
        self.up = True

    def succeeded(self, **extra: Any) -> None:
        if not self.up:
            log.info(self.up_event, **self.context, **extra)
        self.up = True

    def failed(self, error: BaseException) -> None:
        if self.up:
            log.warning(self.down_event, **self.context, error=str(error))
        self.up = False
