"""The ledger process: routers' batch streams in Redis -> the durable store, exactly once.

Each pass, for every router: read the stream past the store's cursor, apply those batches
(counts + cursor in one transaction), then tell the router (ack key) and trim the stream.
Crash anywhere and the next pass repeats the unacknowledged part; the cursor makes that a
no-op. The pass also records each live worker's uptime span (for serving cost) and each
model's price and training cost as the workers publish them.
"""

from __future__ import annotations

import json

import redis
import structlog

from common import mesh_state
from common.mesh_state import WorkerInfo
from ledger.config import LedgerConfig
from ledger.store import BatchEntry, Store, WorkerSpan

log = structlog.get_logger()

READ_COUNT = 10_000


def worker_kind(provider: str) -> str:
    return "gpu" if "CUDA" in provider or "Tensorrt" in provider else "cpu"


def parse_entry(entry_id: str, fields: dict[str, str]) -> BatchEntry:
    usage = {}
    for key, counts in json.loads(fields["usage"]).items():
        usage[mesh_state.parse_model_key(key)] = [int(c) for c in counts]
    return BatchEntry(int(entry_id.split("-")[0]), usage, int(fields["at_ms"]))


class Consumer:
    def __init__(self, redis_url: str, store: Store, config: LedgerConfig) -> None:
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
        self.store = store
        self.config = config
        self._cursors: dict[str, int] = {}  # router -> seq committed (read once, then ours)
        self._terms: dict[str, tuple[int, int]] = {}  # model -> (p, T) as last recorded

    def flush(self) -> int:
        """One pass; returns the number of batches applied."""
        applied = 0
        routers: set[str] = self.redis.smembers(mesh_state.ROUTERS)  # type: ignore[assignment]
        for router_id in sorted(routers):
            applied += self._drain(router_id)
        self._record_registry()
        return applied

    def _drain(self, router_id: str) -> int:
        stream = mesh_state.calls_stream(router_id)
        if router_id not in self._cursors:
            self._cursors[router_id] = self.store.cursor(router_id)
        cursor = self._cursors[router_id]
        applied = 0
        while True:
            raw = self.redis.xrange(stream, min=f"{cursor + 1}-0", count=READ_COUNT)
            entries = [parse_entry(i, f) for i, f in raw]  # type: ignore[union-attr]
            if entries:
                new = self.store.apply(router_id, entries, mesh_state.now_ms())
                applied += new - cursor
                cursor = self._cursors[router_id] = new
            # Ack even with nothing new: a Redis that restarted lost the previous ack.
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(mesh_state.ledger_ack_key(router_id), cursor)
            if cursor:
                pipe.xtrim(stream, minid=f"{cursor + 1}-0", approximate=False)
            pipe.execute()
            if len(entries) < READ_COUNT:
                return applied

    def _record_registry(self) -> None:
        now = mesh_state.now_ms()
        ids: list[str] = self.redis.zrangebyscore(mesh_state.WORKERS, now - 60_000, "+inf")  # type: ignore[assignment]
        if not ids:
            return
        infos = self.redis.mget([mesh_state.worker_key(i) for i in ids])
        spans = []
        for raw in infos:  # type: ignore[union-attr]
            if raw is None:
                continue
            info = WorkerInfo.from_json(raw)
            spans.append(WorkerSpan(info.id, info.started_ms, worker_kind(info.provider), now))
            for name, entry in info.models.items():
                terms = (entry.price_micro_usd, entry.training_cost_micro_usd)
                if name not in self.config.models and self._terms.get(name) != terms:
                    self.store.record_model(name, *terms)  # only when they change
                    self._terms[name] = terms
        self.store.record_workers(spans)

    def close(self) -> None:
        self.redis.close()
