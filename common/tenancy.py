"""Tenants and their API keys: names, policies and key records as Redis holds them.

A tenant is a name (`check_tenant`) with a `TenantPolicy`: the models it may call, its
limits (requests per second with a burst, tokens per minute, a monthly spend cap in
micro-USD; 0 = no limit) and whether it is an admin (sees prices in ModelConfig). An API key
is `ms_<key id>_<secret>`: 128 random bits of secret, stored only as its SHA-256 (a key is
random, not a password: a fast hash is enough and lets the router check a key in one
lookup). The key id is public (list, revoke, logs); the key never appears in a log.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import asdict, dataclass, field

from common import model_keys

# meshserve's ModelConfig parameters that are the mesh's business, not the client's: a
# client that is not an admin gets the ModelConfig without them.
PRICE_PER_CALL = model_keys.PRICE_PER_CALL
# An LLM's prices per 1,000 tokens: prompt (input) and completion (output) tokens.
PRICE_PER_1K_INPUT = model_keys.PRICE_PER_1K_INPUT
PRICE_PER_1K_OUTPUT = model_keys.PRICE_PER_1K_OUTPUT
TRAINING_COST = model_keys.TRAINING_COST
PRIVATE_PARAMETERS = model_keys.PRIVATE

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
KEY_FORMAT = re.compile(r"^ms_([0-9a-f]{8})_([A-Za-z0-9_-]{22,64})$")
ALL_MODELS = "*"
# Priority classes and the factor each scales the router's queue-wait bound by
# (router/forwarding/shedding.py): lower classes are shed first, at lower predicted waits.
PRIORITIES = {"high": 2.0, "normal": 1.0, "low": 0.5}
MAX_WEIGHT = 1000.0  # a tenant's share weight in the engines' fair admission


def check_tenant(name: str) -> str:
    if not TENANT_NAME.match(name):
        raise ValueError(
            f"tenant name {name[:64]!r}: 1-64 characters of a-z 0-9 _ . -, starting with a "
            "letter or digit"
        )
    return name


def new_key() -> tuple[str, str]:
    """-> (key id, the key): the key is shown once, to the person who asked for it."""
    key_id = secrets.token_hex(4)
    return key_id, f"ms_{key_id}_{secrets.token_urlsafe(16)}"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The public id of a well-formed key (for logs), None for anything else."""
    m = KEY_FORMAT.match(key)
    return m.group(1) if m else None


def _number(raw: dict, name: str, kind: type, limit: float) -> float:
    value = raw.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= limit:
        raise ValueError(f"{name!r} must be a number in 0..{limit:g}, not {str(value)[:32]!r}")
    if kind is int and not isinstance(value, int):
        raise ValueError(f"{name!r} must be an integer, not {value!r}")
    return value


@dataclass(frozen=True)
class TenantPolicy:
    models: tuple[str, ...] = (ALL_MODELS,)  # the models it may call; "*": every model
    requests_per_second: float = 0.0  # 0: no limit
    burst: int = 0  # requests allowed at once above the rate; 0: one second's worth
    tokens_per_minute: int = 0  # prompt + completion tokens; 0: no limit
    monthly_spend_cap_micro_usd: int = 0  # 0: no cap
    admin: bool = False
    priority: str = "normal"  # a key of PRIORITIES: when its calls are shed under overload
    weight: float = 1.0  # its share of an engine against other backlogged tenants
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def allows(self, model: str) -> bool:
        return ALL_MODELS in self.models or model in self.models

    @property
    def bucket_size(self) -> int:
        return self.burst or max(1, int(self.requests_per_second))

    @property
    def limited(self) -> bool:
        return bool(
            self.requests_per_second or self.tokens_per_minute or self.monthly_spend_cap_micro_usd
        )

    def to_json(self) -> str:
        raw = asdict(self)
        raw["models"] = list(self.models)
        raw.pop("extra")
        return json.dumps(raw, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> TenantPolicy:
        """Parse and check a policy read from Redis; ValueError says what is wrong."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a tenant policy is a JSON object")
        models = raw.get("models")
        if (
            not isinstance(models, list)
            or not models
            or not all(isinstance(m, str) and 0 < len(m) <= 256 for m in models)
        ):
            raise ValueError("'models' must be a non-empty list of model names (or '*')")
        admin = raw.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError("'admin' must be true or false")
        priority = raw.get("priority", "normal")
        if priority not in PRIORITIES:
            raise ValueError(f"'priority' must be one of {sorted(PRIORITIES)}, not {priority!r}")
        weight = raw.get("weight", 1.0)
        number = isinstance(weight, int | float) and not isinstance(weight, bool)
        if not number or not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"'weight' must be a number in (0, {MAX_WEIGHT:g}]")
        return cls(
            models=tuple(models),
            requests_per_second=float(_number(raw, "requests_per_second", float, 1e6)),
            burst=int(_number(raw, "burst", int, 1e9)),
            tokens_per_minute=int(_number(raw, "tokens_per_minute", int, 1e12)),
            monthly_spend_cap_micro_usd=int(
                _number(raw, "monthly_spend_cap_micro_usd", int, 2**62)
            ),
            admin=admin,
            priority=priority,
            weight=float(weight),
        )


@dataclass(frozen=True)
class KeyRecord:
    """What Redis holds for one API key (found by the key's hash)."""

    tenant: str
    key_id: str
    created_ms: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KeyRecord:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a key record is a JSON object")
        tenant, key_id, created = raw.get("tenant"), raw.get("key_id"), raw.get("created_ms")
        if not isinstance(tenant, str) or not isinstance(key_id, str):
            raise ValueError("'tenant' and 'key_id' must be strings")
        if isinstance(created, bool) or not isinstance(created, int) or created < 0:
            raise ValueError("'created_ms' must be an integer >= 0")
        return cls(check_tenant(tenant), key_id, created)
