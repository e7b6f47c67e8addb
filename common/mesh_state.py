"""Redis as the mesh's shared state: every key meshserve uses, built here and nowhere else.

Every key, its type, its writer -> its readers, and what it holds:

- meshserve:workers (ZSET, worker -> router): worker id -> last heartbeat, unix ms.
- meshserve:worker:{id} (STRING, worker -> router): WorkerInfo as JSON; expires after the
  registry TTL unless the heartbeat renews it.
- meshserve:depth:{id} (STRING, worker -> router): "depth:unix_ms", the worker's requests
  waiting + running and when that was sampled; a worker serving an LLM engine appends
  ":kv_used:kv_total", the KV cache tokens its running sequences hold and its budget.
  Expires with the registry TTL.
- meshserve:usage:{router} (HASH, router -> ledger, tests): "{model}|{version}|{field}" ->
  the router's cumulative count since it started.
- meshserve:routers (SET, router -> ledger, tests): router ids that have written usage.
- meshserve:calls:{router} (STREAM, router -> ledger): one entry per accounting batch, id
  "{seq}-1" with seq counting 1, 2, 3... per router; field "usage" is JSON
  {"model|version": [calls, success, errors, revenue_micro_usd, upstream_ns]}, field "at_ms"
  when the batch closed. The ledger applies entries in seq order, exactly once.
- meshserve:ledger:ack:{router} (STRING, ledger -> router): the highest seq of that router the
  durable ledger has committed; the router forgets batches up to it.

Usage is written as absolute totals per router (HSET, not HINCRBY): writing the same totals
twice changes nothing, and a Redis that restarted empty gets the full totals back on the
router's next flush. Fields: calls, success, errors, revenue_micro_usd.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

PREFIX = "meshserve"
WORKERS = f"{PREFIX}:workers"
ROUTERS = f"{PREFIX}:routers"
# The counts of one model version, in this order wherever they travel as a list (batches).
USAGE_FIELDS = ("calls", "success", "errors", "revenue_micro_usd", "upstream_ns")


def now_ms() -> int:
    """Unix time in ms: the clock of every timestamp in Redis (heartbeats, depth samples)."""
    return time.time_ns() // 1_000_000


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def depth_key(worker_id: str) -> str:
    return f"{PREFIX}:depth:{worker_id}"


def usage_key(router_id: str) -> str:
    return f"{PREFIX}:usage:{router_id}"


def model_key(model: str, version: str) -> str:
    return f"{model}|{version}"


def parse_model_key(key: str) -> tuple[str, str]:
    model, version = key.rsplit("|", 1)
    return model, version


def usage_field(model: str, version: str, name: str) -> str:
    return f"{model}|{version}|{name}"


def calls_stream(router_id: str) -> str:
    return f"{PREFIX}:calls:{router_id}"


def ledger_ack_key(router_id: str) -> str:
    return f"{PREFIX}:ledger:ack:{router_id}"


def parse_usage_field(key: str) -> tuple[str, str, str]:
    model, version, name = key.rsplit("|", 2)
    return model, version, name


@dataclass(frozen=True)
class ModelEntry:
    versions: list[str]
    max_queue: int
    price_micro_usd: int = 0
    training_cost_micro_usd: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    address: str  # host:port the router dials
    models: dict[str, ModelEntry]
    provider: str  # the execution provider onnxruntime actually runs on
    tp: int = 1  # tensor-parallel size; the router treats a TP group as one replica
    started_ms: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        raw = json.loads(text)
        raw["models"] = {name: ModelEntry(**m) for name, m in raw["models"].items()}
        return cls(**raw)


@dataclass(frozen=True)
class DepthSample:
    depth: int
    at_ms: int
    kv_used: int = 0  # KV cache tokens held (LLM engines only; 0 and 0 otherwise)
    kv_total: int = 0

    def encode(self) -> str:
        kv = f":{self.kv_used}:{self.kv_total}" if self.kv_total else ""
        return f"{self.depth}:{self.at_ms}{kv}"

    @classmethod
    def decode(cls, text: str | bytes) -> DepthSample:
        if isinstance(text, bytes):
            text = text.decode()
        parts = [int(p) for p in text.split(":")]
        if len(parts) not in (2, 4):
            raise ValueError(f"depth sample {text[:64]!r}: expected depth:at_ms[:kv_used:kv_total]")
        return cls(*parts)
