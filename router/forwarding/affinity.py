"""Session affinity: the conversation a request belongs to -> the replica that served it.

A request names its conversation with a request parameter (`session_id`, or
`conversation_id`); the replica that served the conversation before holds its prefix, so the
next turn goes there while it has room (see Policy.choose, Ask.preferred). The map is a bounded
LRU per router: a client-chosen string costs at most `max_sessions` entries of at most
`MAX_SESSION` characters, and a session the router forgot is balanced like any request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

SESSION_KEYS = ("session_id", "conversation_id")
MAX_SESSION = 256  # chars; a longer id is not remembered


def session_of(parameters: Mapping[str, Any]) -> str | None:
    """The session a request names in its parameters map (InferHeader.parameters), if any."""
    for key in SESSION_KEYS:
        if key in parameters:
            p = parameters[key]
            which = p.WhichOneof("parameter_choice")
            if which in ("string_param", "int64_param", "uint64_param"):
                value = str(getattr(p, which))
                if value and len(value) <= MAX_SESSION:
                    return value
    return None


class Affinity:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._map: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def get(self, model: str, session: str | None) -> str | None:
        if session is None:
            return None
        replica = self._map.get((model, session))
        if replica is not None:
            self._map.move_to_end((model, session))
        return replica

    def remember(self, model: str, session: str | None, replica: str) -> None:
        if session is None or self.max_sessions <= 0:
            return
        self._map[(model, session)] = replica
        self._map.move_to_end((model, session))
        while len(self._map) > self.max_sessions:
            self._map.popitem(last=False)
