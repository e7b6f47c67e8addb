"""Refill Redis's tenant records from the database (common/tenant_directory.py), without a person.

Each ledger pass compares `meshserve:tenants:version` in Redis with the directory's
version. When they differ (a Redis that restarted without them, an old AOF, a new node, a
replica that lagged when it took over) or every `full_every_s` (a Redis that lost some keys
and kept the version: eviction, a hand-made DEL), Redis is made to hold exactly the
directory:

- every tenant's policy and the tenants set; tenants Redis has and the directory does not
  are removed;
- every live key's record; every revoked key's record deleted, and any other key record
  (`meshserve:apikey:*` not in the directory) deleted;
- this month's spend counter raised to what the ledger has counted (never lowered: the
  routers' counter runs ahead of the ledger by a flush or two);
- then the version, last, and only if the directory did not change meanwhile (else the
  refill runs again), so a Redis that shows the directory's version holds all of it.

Every write sets a value (SET, SADD, DEL, a raise-to script): the refill is idempotent, and
running it twice, or on a Redis that already holds the state, changes nothing. A key
revoked in the directory never comes back: a refill deletes it, and a refill that raced
the revocation runs again before it writes the version.

A directory that was never written (version 0, no tenant) refills nothing and deletes
nothing, so a mesh whose tenants still live only in Redis (from before the database held
them) keeps them: `python -m router tenants import` copies them in.
"""

from __future__ import annotations

import time

import redis
import structlog

from common import mesh_state
from common.tenant_directory import Snapshot, TenantDirectory
from ledger.store import Store, utc_month

log = structlog.get_logger()

SPEND_TTL_S = 40 * 86400  # router/tenancy/limits.py's: a month's counter outlives its month
MAX_TRIES = 3
CHUNK = 500  # commands per pipeline round trip

# KEYS[1]: a spend counter. ARGV: the ledger's count, the TTL. Raise, never lower.
RAISE_TO = """
local have = tonumber(redis.call('GET', KEYS[1]) or '0')
if have < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return 1
end
return 0
"""


class Refiller:
    def __init__(
        self, client: redis.Redis, directory: TenantDirectory, store: Store, full_every_s: float
    ) -> None:
        self.redis = client
        self.directory = directory
        self.store = store
        self.full_every_s = full_every_s
        self._raise_to = client.register_script(RAISE_TO)
        self._next_full = 0.0
        self.refills = 0  # passes that wrote Redis (for tests and the log)

    def check(self) -> bool:
        """One ledger pass's look; True when it refilled."""
        have = self.redis.get(mesh_state.TENANTS_VERSION)
        want = self.directory.version()
        due = time.monotonic() >= self._next_full
        if have == str(want) and not due:
            return False
        if want == 0 and not self.directory.tenants():
            self._next_full = time.monotonic() + self.full_every_s
            return False
        refilled = self.refill(reason="version" if have != str(want) else "periodic")
        self._next_full = time.monotonic() + self.full_every_s
        return refilled

    def refill(self, reason: str = "asked") -> bool:
        for _ in range(MAX_TRIES):
            snapshot = self.directory.snapshot()
            changed = self._write(snapshot)
            if self.directory.version() == snapshot.version:
                self.redis.set(mesh_state.TENANTS_VERSION, str(snapshot.version))
                if changed or reason == "version":
                    self.refills += 1
                    log.warning(
                        "tenants_refilled_from_database",
                        reason=reason,
                        version=snapshot.version,
                        tenants=len(snapshot.policies),
                        keys=len(snapshot.live),
                        writes=changed,
                    )
                return True
        log.error("tenants_refill_raced_admin_writes", tries=MAX_TRIES)
        return False

    def _write(self, snapshot: Snapshot) -> int:
        """Make Redis hold the snapshot; returns how many records it changed."""
        commands: list[tuple] = []
        policies = snapshot.policies
        have_tenants: set[str] = self.redis.smembers(mesh_state.TENANTS)  # type: ignore[assignment]
        names = sorted(policies)
        texts = self.redis.mget([mesh_state.tenant_key(t) for t in names]) if names else []
        for tenant, text in zip(names, texts, strict=True):  # type: ignore[arg-type]
            if text != policies[tenant].to_json():
                commands.append(("set", mesh_state.tenant_key(tenant), policies[tenant].to_json()))
        for tenant in sorted(set(policies) - have_tenants):
            commands.append(("sadd", mesh_state.TENANTS, tenant))
        for tenant in sorted(have_tenants - set(policies)):
            commands.append(("srem", mesh_state.TENANTS, tenant))
            commands.append(("delete", mesh_state.tenant_key(tenant)))
        live = {row.digest: row.record.to_json() for row in snapshot.live}
        digests = sorted(live)
        records = self.redis.mget([mesh_state.api_key_key(d) for d in digests]) if digests else []
        for digest, text in zip(digests, records, strict=True):  # type: ignore[arg-type]
            if text != live[digest]:
                commands.append(("set", mesh_state.api_key_key(digest), live[digest]))
        stale = {row.digest for row in snapshot.revoked}
        prefix = mesh_state.api_key_key("")
        for name in self.redis.scan_iter(match=f"{prefix}*", count=1000):
            if name[len(prefix) :] not in live:
                stale.add(name[len(prefix) :])
        present = self._existing([mesh_state.api_key_key(d) for d in sorted(stale)])
        commands += [("delete", name) for name in present]
        self._run(commands)
        return len(commands) + self._raise_spend(set(policies))

    def _existing(self, names: list[str]) -> list[str]:
        found = []
        for start in range(0, len(names), CHUNK):
            chunk = names[start : start + CHUNK]
            pipe = self.redis.pipeline(transaction=False)
            for name in chunk:
                pipe.exists(name)
            found += [n for n, e in zip(chunk, pipe.execute(), strict=True) if e]
        return found

    def _run(self, commands: list[tuple]) -> None:
        for start in range(0, len(commands), CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for op, key, *value in commands[start : start + CHUNK]:
                match op:
                    case "set":
                        pipe.set(key, value[0])
                    case "sadd":
                        pipe.sadd(key, value[0])
                    case "srem":
                        pipe.srem(key, value[0])
                    case "delete":
                        pipe.delete(key)
            pipe.execute()

    def _raise_spend(self, tenants: set[str]) -> int:
        month = utc_month(mesh_state.now_ms())
        raised = 0
        for tenant, spend in self.store.tenant_spend(month).items():
            if tenant in tenants and spend > 0:
                key = mesh_state.spend_key(tenant, month)
                raised += int(self._raise_to(keys=[key], args=[spend, SPEND_TTL_S]))  # type: ignore[arg-type]
        return raised
