"""Redis as the mesh's shared state: every key meshserve uses, built here and nowhere else.

Every key, its type, its writer -> its readers, and what it holds:

- meshserve:workers (ZSET, worker -> router): worker id -> last heartbeat, unix ms.
- meshserve:worker:{id} (STRING, worker -> router): WorkerInfo as JSON; expires after the
  registry TTL unless the heartbeat renews it.
- meshserve:depth:{id} (STRING, worker -> router): "depth:unix_ms", the worker's requests
  waiting + running and when that was sampled; a worker serving an LLM engine appends
  ":kv_used:kv_total", the KV cache tokens its running sequences hold and its budget, then
  ":slots:rate_milli", the sequences it runs at once and the rate its requests finish
  (per 1,000 s, measured: worker/llm/service_time.py), from which a router predicts the
  wait of a new request (router/forwarding/shedding.py). Expires with the registry TTL.
- meshserve:scale:{model}:queue (LIST, worker -> KEDA's Redis scaler, tests): its LENGTH is
  the model's queue depth over the mesh: the requests (LLM: sequences) waiting + running on
  every live replica serving the model, summed; the elements are placeholders. KEDA's
  `redis` trigger reads a key's length (LLEN), so the count is the length; a worker resizes
  the list in the script that records its own share (worker/scaling.py), so it is exact at
  every write. Expires with the registry TTL when no replica writes (no replica: 0).
- meshserve:scale:{model}:kv (LIST, worker -> KEDA, tests): LLM models only; its length is
  the sum over the model's replicas of each one's KV cache occupancy in percent (0-100), so
  a target of 70 per replica keeps the mean occupancy at or under 70%. Same expiry.
- meshserve:scale:{model}:replicas (HASH, worker -> worker/scaling.py's script): worker id ->
  "depth:kv_percent:redis_ms", each replica's share of the two lists and when (Redis's own
  clock) it was written; a share older than the registry TTL (a dead replica) is dropped
  and left out of the sums by the next write. A draining worker removes its share.
- meshserve:registry:events (PUB/SUB channel, worker -> router): changes pushed as they
  happen, so a router need not poll (see `RegistryEvent`): "join {id}" when a worker
  (re-)registers, "leave {id}" when it deregisters, "depth {id} {sample}" with each new
  depth sample (DepthSample.encode, also written to the depth key). Nothing is kept: a
  router that was not subscribed reads the keys above (its slow poll, and on subscribing).
- meshserve:usage:{router} (HASH, router -> ledger, tests): "{model}|{version}|{field}" ->
  the router's cumulative count since it started.
- meshserve:routers (SET, router -> ledger, tests): router ids that have written usage.
- meshserve:calls:{router} (STREAM, router -> ledger): one entry per accounting batch, id
  "{epoch}-{seq}": epoch is the router process's start (unix ms, above any id already
  there), seq counts 1, 2, 3... within the process; field "usage" is JSON
  {"model|version": [USAGE_FIELDS in order]} ("model|version|tenant" for a tenant's
  calls) (success and revenue negative for a refund;
  the token fields negative for a streamed piece whose delivery failed after it was
  recorded), field "at_ms" when the batch closed. A batch of a router that predates token
  pricing has the first five fields only, one that predates cached tokens the first eleven
  (CALL_FIELDS + TOKEN_FIELDS), one that predates load shedding the first thirteen. The
  ledger applies entries in id order, exactly once, and quarantines what fails its checks.
- meshserve:ledger:ack:{router} (STRING, ledger -> router): "{epoch}-{seq}", the highest id
  of that router the durable ledger has committed; the router forgets batches up to it.

Tenants (router/tenancy/auth.py, router/tenancy/limits.py). Their source of truth is the
ledger's database
(common/tenant_directory.py); these keys are its serving copy, written by `python -m router
keys|tenants` (the admin role) after the database, and refilled by the ledger
(ledger/refill.py) when Redis lost them:

- meshserve:tenants (SET, admin, ledger -> router, ledger): every tenant name.
- meshserve:tenant:{tenant} (STRING, admin, ledger -> router): TenantPolicy as JSON: the
  models it may call, its rate limits and monthly spend cap, whether it is an admin.
- meshserve:apikey:{sha256 hex} (STRING, admin, ledger -> router): {"tenant", "key_id",
  "created_ms"} for one live API key, found by the key's SHA-256 (the key itself is never
  stored). A revoked key has none.
- meshserve:tenants:version (STRING, admin, ledger -> router, ledger): the directory version
  (a count raised by every change in the database) that Redis holds all of; written last.
  Missing, or below one a router saw before: Redis is not (yet) filled, and a router does
  not call a key unknown that it cannot find (UNAVAILABLE, or its cached verdict).
- meshserve:apikeys:{tenant} (HASH, admin -> admin): key id -> "sha256:created_ms", where
  meshserve kept a tenant's keys before the database did; read only by `python -m router
  tenants import`.
- meshserve:limit:{tenant}:rps, meshserve:limit:{tenant}:tpm (HASH, router <-> router):
  token buckets {"level", "at_us"}, read and written only by router/tenancy/limits.py's scripts.
- meshserve:spend:{tenant}:{YYYYMM} (STRING, router <-> router; ledger raises it): micro-USD
  the tenant was billed this UTC month, for its spend cap; a refill raises it to what the
  ledger counted (never lowers it).

Everything read from Redis is checked before use (`WorkerInfo.from_json`,
`DepthSample.decode`, `TenantPolicy.from_json`, the ledger's `parse_entry`); with the ACL
users of `devmesh/redis_acl.py` each role may write only its own keys.

Usage is written as absolute totals per router (HSET, not HINCRBY): writing the same totals
twice changes nothing, and a Redis that restarted empty gets the full totals back on the
router's next flush. Fields: USAGE_FIELDS.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

PREFIX = "meshserve"
WORKERS = f"{PREFIX}:workers"
ROUTERS = f"{PREFIX}:routers"
REGISTRY_EVENTS = f"{PREFIX}:registry:events"
# The counts of one model version, in this order wherever they travel as a list (batches).
# Calls: calls, success, errors, revenue_micro_usd (per-call price), upstream_ns. Tokens (LLM
# models): prompt and completion tokens billed, their revenue at the per-1k-token prices, and
# how the successful calls finished (the worker's finish_reason: stop, length, else other).
CALL_FIELDS = ("calls", "success", "errors", "revenue_micro_usd", "upstream_ns")
TOKEN_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "token_revenue_micro_usd",
    "finished_stop",
    "finished_length",
    "finished_other",
)
# Prompt tokens served from the workers' prefix caches (billed at the cached-input price),
# and what that price took off the token revenue (at the input price for every token).
CACHE_FIELDS = ("cached_tokens", "cached_discount_micro_usd")
# Of the errors: calls the router shed before they started (router/forwarding/shedding.py: the
# predicted queue wait was over the caller's bound; answered RESOURCE_EXHAUSTED with
# retry-after, no revenue).
SHED_FIELDS = ("shed",)
USAGE_FIELDS = CALL_FIELDS + TOKEN_FIELDS + CACHE_FIELDS + SHED_FIELDS


def now_ms() -> int:
    """Unix time in ms: the clock of every timestamp in Redis (heartbeats, depth samples)."""
    return time.time_ns() // 1_000_000


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def depth_key(worker_id: str) -> str:
    return f"{PREFIX}:depth:{worker_id}"


def scale_queue_key(model: str) -> str:
    return f"{PREFIX}:scale:{model}:queue"


def scale_kv_key(model: str) -> str:
    return f"{PREFIX}:scale:{model}:kv"


def scale_replicas_key(model: str) -> str:
    return f"{PREFIX}:scale:{model}:replicas"


def usage_key(router_id: str) -> str:
    return f"{PREFIX}:usage:{router_id}"


def model_key(model: str, version: str, tenant: str = "") -> str:
    """A batch's usage key: "model|version", or "model|version|tenant" for a tenant's calls."""
    return f"{model}|{version}|{tenant}" if tenant else f"{model}|{version}"


def parse_model_key(key: str) -> tuple[str, str, str]:
    """-> (model, version, tenant); tenant "" when the call had none (auth off)."""
    parts = key.split("|")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else ""


TENANTS = f"{PREFIX}:tenants"


def tenant_key(tenant: str) -> str:
    return f"{PREFIX}:tenant:{tenant}"


def api_key_key(key_sha256: str) -> str:
    return f"{PREFIX}:apikey:{key_sha256}"


TENANTS_VERSION = f"{PREFIX}:tenants:version"


def tenant_keys_key(tenant: str) -> str:
    return f"{PREFIX}:apikeys:{tenant}"


def limit_key(tenant: str, kind: str) -> str:
    return f"{PREFIX}:limit:{tenant}:{kind}"


def spend_key(tenant: str, month: str) -> str:
    return f"{PREFIX}:spend:{tenant}:{month}"


def usage_field(model: str, version: str, name: str) -> str:
    return f"{model}|{version}|{name}"


def calls_stream(router_id: str) -> str:
    return f"{PREFIX}:calls:{router_id}"


def ledger_ack_key(router_id: str) -> str:
    return f"{PREFIX}:ledger:ack:{router_id}"


def parse_usage_field(key: str) -> tuple[str, str, str]:
    model, version, name = key.rsplit("|", 2)
    return model, version, name


CACHED_PRICE = "price_per_1k_cached_input_tokens_micro_usd"


@dataclass(frozen=True)
class ModelEntry:
    versions: list[str]
    max_queue: int
    price_micro_usd: int = 0
    training_cost_micro_usd: int = 0
    # LLM models: micro-USD per 1,000 prompt (input) and completion (output) tokens.
    price_per_1k_input_tokens_micro_usd: int = 0
    price_per_1k_output_tokens_micro_usd: int = 0
    # prompt tokens served from the worker's prefix cache; None (unset): the input price
    price_per_1k_cached_input_tokens_micro_usd: int | None = None

    @property
    def cached_input_price(self) -> int:
        """micro-USD per 1,000 cached prompt tokens: the input price unless set."""
        p = self.price_per_1k_cached_input_tokens_micro_usd
        return self.price_per_1k_input_tokens_micro_usd if p is None else p

    @property
    def prices(self) -> tuple[int, int, int]:
        """(per call, per 1k input tokens, per 1k output tokens): equal on every replica."""
        return (
            self.price_micro_usd,
            self.price_per_1k_input_tokens_micro_usd,
            self.price_per_1k_output_tokens_micro_usd,
        )


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
        """Parse and check a registration; ValueError says what is wrong with it.

        Fields this version does not know are ignored (a newer worker may add some); a
        missing field, a wrong type, a negative count or price, or a model or version name
        that cannot be part of a usage key is an error."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a registration is a JSON object")
        models = raw.get("models")
        if not isinstance(models, dict) or not models:
            raise ValueError("'models' must be a non-empty object")
        entries = {}
        for name, m in models.items():
            _check_name("model", name)
            if not isinstance(m, dict):
                raise ValueError(f"model {name[:64]!r}: an object expected")
            versions = m.get("versions")
            if not isinstance(versions, list) or not versions:
                raise ValueError(f"model {name[:64]!r}: 'versions' must be a non-empty list")
            for v in versions:
                _check_name("version", v)
            entries[name] = ModelEntry(
                versions=list(versions),
                max_queue=_count(m, "max_queue", name),
                price_micro_usd=_count(m, "price_micro_usd", name, 0),
                training_cost_micro_usd=_count(m, "training_cost_micro_usd", name, 0),
                price_per_1k_input_tokens_micro_usd=_count(
                    m, "price_per_1k_input_tokens_micro_usd", name, 0
                ),
                price_per_1k_output_tokens_micro_usd=_count(
                    m, "price_per_1k_output_tokens_micro_usd", name, 0
                ),
                price_per_1k_cached_input_tokens_micro_usd=(
                    _count(m, CACHED_PRICE, name) if m.get(CACHED_PRICE) is not None else None
                ),
            )
        address = raw.get("address")
        host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"'address' must be host:port, not {str(address)[:64]!r}")
        for key in ("id", "provider"):
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise ValueError(f"{key!r} must be a non-empty string")
        extra = raw.get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError("'extra' must be an object")
        return cls(
            id=raw["id"],
            address=str(address),
            models=entries,
            provider=raw["provider"],
            tp=_count(raw, "tp", "", 1) or 1,
            started_ms=_count(raw, "started_ms", "", 0),
            extra={str(k): str(v) for k, v in extra.items()},
        )


MAX_NAME = 256  # chars in a model or version name


def _check_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or "|" in name:
        raise ValueError(f"{kind} name {str(name)[:64]!r}: 1-{MAX_NAME} chars, no '|'")


def _count(raw: dict, key: str, model: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        where = f"model {model[:64]!r}: " if model else ""
        raise ValueError(f"{where}{key!r} must be an integer >= 0, not {str(value)[:32]!r}")
    return value


@dataclass(frozen=True)
class DepthSample:
    depth: int
    at_ms: int
    kv_used: int = 0  # KV cache tokens held (LLM engines only; 0 and 0 otherwise)
    kv_total: int = 0
    slots: int = 0  # requests it runs at once (LLM engines; 0: no service rate published)
    rate_milli: int = 0  # requests it finishes per 1,000 s with its slots busy (0: unknown)

    def encode(self) -> str:
        kv = f":{self.kv_used}:{self.kv_total}" if self.kv_total or self.slots else ""
        service = f":{self.slots}:{self.rate_milli}" if self.slots else ""
        return f"{self.depth}:{self.at_ms}{kv}{service}"

    @classmethod
    def decode(cls, text: str | bytes) -> DepthSample:
        """ValueError unless "depth:unix_ms[:kv_used:kv_total[:slots:rate_milli]]", every
        part an integer >= 0."""
        if isinstance(text, bytes):
            text = text.decode()
        parts = [int(p) for p in text.split(":")]
        if len(parts) not in (2, 4, 6):
            raise ValueError(
                f"depth sample {text[:64]!r}: expected "
                "depth:at_ms[:kv_used:kv_total[:slots:rate_milli]]"
            )
        sample = cls(*parts)
        if min(parts) < 0 or sample.kv_used > sample.kv_total:
            raise ValueError(f"a negative or inconsistent depth sample: {text[:64]!r}")
        return sample


@dataclass(frozen=True)
class RegistryEvent:
    """One message on REGISTRY_EVENTS: kind "join", "leave" or "depth", the worker id, and
    for "depth" the sample's text (checked with DepthSample.decode where it is used)."""

    kind: str
    worker_id: str
    sample: str = ""

    KINDS = ("join", "leave", "depth")

    def encode(self) -> str:
        return f"{self.kind} {self.worker_id} {self.sample}".rstrip()

    @classmethod
    def decode(cls, text: str | bytes) -> RegistryEvent:
        """ValueError unless "join|leave {id}" or "depth {id} {sample}"."""
        if isinstance(text, bytes):
            text = text.decode()
        kind, _, rest = text.partition(" ")
        if kind == "depth":
            worker_id, _, sample = rest.rpartition(" ")
        else:
            worker_id, sample = rest, ""
        if kind not in cls.KINDS or not worker_id or (kind == "depth") != bool(sample):
            raise ValueError(f"registry event {text[:64]!r}: expected join|leave ID, depth ID S")
        return cls(kind, worker_id, sample)
