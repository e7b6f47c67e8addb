"""Who is calling, and may they: API key -> tenant, the tenant's models, its limits.

A call carries `authorization: Bearer <key>` metadata. The key's SHA-256 finds its record
in Redis (common/tenancy.py, keys in common/mesh_state.py), and the record its tenant's
policy. Missing, malformed, unknown or revoked key -> UNAUTHENTICATED; a model the tenant
may not call -> PERMISSION_DENIED (whether the mesh serves it or not: a tenant learns
nothing of models it may not use); over a limit -> RESOURCE_EXHAUSTED (router/tenancy/limits.py).

A looked-up key is cached for `cache_s` (1 s): a revoked key stops working within that,
and the hot path needs no Redis read for the key. A key record or policy in Redis that
does not parse is refused (logged once per text) and never trusted. While Redis is down,
keys seen before go on working from the cache; others are UNAVAILABLE. So while Redis holds
no tenant directory, or an older one than this router saw (`meshserve:tenants:version`,
until the ledger refills it from its database): a key Redis lacks is then not called unknown.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from common import mesh_state
from common.errors import PermissionDenied, Unauthenticated, Unavailable, clip
from common.tenancy import PRIVATE_PARAMETERS, KeyRecord, TenantPolicy, key_hash, key_id_of
from router.tenancy.limits import Limiter

log = structlog.get_logger()

MAX_CACHED = 10_000
BEARER = "bearer "


class NotFilled(Exception):
    """Redis answered, but without the tenant directory (restarted empty, an old AOF): a
    key it lacks is not known to be unknown."""


@dataclass(frozen=True)
class Tenant:
    name: str
    policy: TenantPolicy
    key_id: str


@dataclass
class _Cached:
    until: float
    tenant: Tenant | None
    refusal: str = ""


class Auth:
    def __init__(self, redis: aioredis.Redis, limiter: Limiter, cache_s: float = 1.0) -> None:
        self.redis = redis
        self.limiter = limiter
        self.cache_s = cache_s
        self._cache: dict[str, _Cached] = {}
        self._policies: dict[str, TenantPolicy] = {}  # tenant -> policy last seen
        self._refused: set[str] = set()  # texts logged as refused (once each)
        self._version_seen = 0  # the highest tenants version Redis showed (mesh_state)

    # -- who -------------------------------------------------------------------------------

    async def authenticate(self, metadata: Sequence[Any] | None) -> Tenant:
        key = _bearer(metadata)
        digest = key_hash(key)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and now < cached.until:
            return _known(cached)
        try:
            entry = await self._lookup(key, digest)
        except (RedisError, OSError, NotFilled) as e:
            if cached is not None and cached.tenant is not None:  # Redis down: last known
                return cached.tenant
            if isinstance(e, NotFilled):
                raise Unavailable(f"cannot check the API key now: {e}") from e
            raise Unavailable(f"cannot check the API key now (Redis: {clip(str(e), 80)})") from e
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[digest] = entry
        return _known(entry)

    async def _lookup(self, key: str, digest: str) -> _Cached:
        until = time.monotonic() + self.cache_s
        record_text, version = await self.redis.mget(
            [mesh_state.api_key_key(digest), mesh_state.TENANTS_VERSION]
        )
        if not self._filled(version):  # neither its record nor its absence is to be trusted
            raise NotFilled("Redis does not hold the tenant records yet (being refilled)")
        if record_text is None:
            log.info("api_key_refused", key_id=key_id_of(key), reason="unknown or revoked")
            return _Cached(until, None, "unknown or revoked API key")
        try:
            record = KeyRecord.from_json(record_text)
            policy_text = await self.redis.get(mesh_state.tenant_key(record.tenant))
            if policy_text is None:
                raise ValueError(f"tenant {record.tenant!r} has no policy")
            policy = TenantPolicy.from_json(policy_text)
        except ValueError as e:
            self._log_refused(digest, str(e))
            return _Cached(until, None, "the API key's record in the mesh is not valid")
        self._policies[record.tenant] = policy
        return _Cached(until, Tenant(record.tenant, policy, record.key_id))

    def _filled(self, version: str | None) -> bool:
        """Whether Redis holds the whole tenant directory: its version is there, and not
        below one seen before (an old AOF, a replica that lagged)."""
        if version is None or not version.isdigit():
            return False
        if int(version) < self._version_seen:
            return False
        self._version_seen = int(version)
        return True

    def _log_refused(self, text: str, reason: str) -> None:
        if text not in self._refused and len(self._refused) < MAX_CACHED:
            self._refused.add(text)
            log.warning("tenant_record_refused", reason=reason[:300])

    # -- may they --------------------------------------------------------------------------

    @staticmethod
    def authorize(tenant: Tenant, model: str) -> None:
        if not tenant.policy.allows(model):
            raise PermissionDenied(
                f"tenant {tenant.name!r} may not call model {clip(model)}; "
                f"it may call {clip(', '.join(tenant.policy.models), 200)}"
            )

    async def admit(self, tenant: Tenant, model: str) -> None:
        """Authorize the model, then one rate-limit decision (router/tenancy/limits.py)."""
        self.authorize(tenant, model)
        await self.limiter.admit(tenant.name, tenant.policy)

    def charge(self, tenant: str, tokens: int, micro_usd: int) -> None:
        """A call's tokens and price, for the tenant's tokens-per-minute and spend cap."""
        policy = self._policies.get(tenant)
        if policy is not None:
            self.limiter.charge(tenant, policy, tokens, micro_usd)

    @staticmethod
    def visible_config(tenant: Tenant | None, config: Any) -> Any:
        """A ModelConfigResponse as the tenant may see it: no prices or training cost unless
        it is an admin (or auth is off)."""
        if tenant is None or tenant.policy.admin:
            return config
        for name in PRIVATE_PARAMETERS & set(config.config.parameters):
            del config.config.parameters[name]
        return config


def _bearer(metadata: Sequence[Any] | None) -> str:
    for item in metadata or ():
        if item[0] == "authorization":
            value = item[1] if isinstance(item[1], str) else item[1].decode(errors="replace")
            value = value.strip()  # perf_analyzer -H 'authorization: Bearer k' keeps the space
            if not value.lower().startswith(BEARER):
                raise Unauthenticated(
                    "the authorization metadata must be 'Bearer <API key>'; "
                    f"it starts {clip(value[:7])}"
                )
            key = value[len(BEARER) :].strip()
            if key_id_of(key) is None:
                raise Unauthenticated(
                    "the API key is not one this mesh issues (expected ms_<key id>_<secret>)"
                )
            return key
    raise Unauthenticated(
        "no API key: send the metadata 'authorization: Bearer <API key>' "
        "(keys: python -m router keys create --tenant T)"
    )


def _known(entry: _Cached) -> Tenant:
    if entry.tenant is None:
        raise Unauthenticated(entry.refusal)
    return entry.tenant
