"""Tenants and API keys, kept in the mesh's database (the ledger's): their source of truth.

Redis holds the serving copy (common/mesh_state.py: the tenant policies, the key records,
and `meshserve:tenants:version`); `python -m router tenants|keys` writes here first, then
Redis, and the ledger refills a Redis that lost them (ledger/refill.py).

Tables (common/sqldb.py: SQLite or PostgreSQL, beside the ledger's):

- tenants (tenant, policy JSON, updated_ms);
- api_keys (key_sha256, tenant, key_id, created_ms, revoked_ms): a revoked key stays as a
  row with revoked_ms > 0, so a refill deletes it from any Redis that still holds it (an
  old AOF, a replica that lagged); a key is never un-revoked;
- tenant_directory (one row): `version`, raised by every change in the same transaction,
  so a Redis whose version differs is known to hold another state than this one.

The tenants' monthly spend is the ledger's `tenant_spend` table (ledger/store.py), counted
from the routers' batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.sqldb import Cursor, Database
from common.tenancy import KeyRecord, TenantPolicy, check_tenant

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS tenants (
        tenant TEXT PRIMARY KEY, policy TEXT NOT NULL, updated_ms BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS api_keys (
        key_sha256 TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_id TEXT NOT NULL,
        created_ms BIGINT NOT NULL, revoked_ms BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS tenant_directory (
        id INTEGER PRIMARY KEY, version BIGINT NOT NULL)""",
    "INSERT INTO tenant_directory VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
]


@dataclass(frozen=True)
class KeyRow:
    digest: str  # the key's SHA-256
    record: KeyRecord
    revoked_ms: int = 0


@dataclass(frozen=True)
class Snapshot:
    """Everything a Redis must hold of the tenants, as of one directory version."""

    version: int
    policies: dict[str, TenantPolicy]
    live: list[KeyRow]
    revoked: list[KeyRow]


class TenantDirectory:
    def __init__(self, db: Database) -> None:
        self.store = db
        db.create(SCHEMA)

    # -- writes (each raises the version in its own transaction) ---------------------------

    def set_tenant(self, tenant: str, policy: TenantPolicy, now_ms: int) -> int:
        check_tenant(tenant)
        with self.store.transaction() as cur:
            cur.execute(
                "INSERT INTO tenants VALUES (?, ?, ?) ON CONFLICT (tenant) DO UPDATE SET "
                "policy = excluded.policy, updated_ms = excluded.updated_ms",
                (tenant, policy.to_json(), now_ms),
            )
            return self._bump(cur)

    def add_key(self, digest: str, record: KeyRecord) -> int:
        with self.store.transaction() as cur:
            if not cur.execute("SELECT 1 FROM tenants WHERE tenant = ?", (record.tenant,)).one():
                raise ValueError(f"tenant {record.tenant!r} does not exist")
            cur.execute(
                "INSERT INTO api_keys VALUES (?, ?, ?, ?, 0)",
                (digest, record.tenant, record.key_id, record.created_ms),
            )
            return self._bump(cur)

    def revoke(self, tenant: str, key_id: str, now_ms: int) -> tuple[str, int] | None:
        """-> (the key's SHA-256, the new version), or None if the tenant has no live key
        with that id."""
        with self.store.transaction() as cur:
            row = cur.execute(
                "SELECT key_sha256 FROM api_keys WHERE tenant = ? AND key_id = ? "
                "AND revoked_ms = 0",
                (check_tenant(tenant), key_id),
            ).one()
            if row is None:
                return None
            cur.execute(
                "UPDATE api_keys SET revoked_ms = ? WHERE key_sha256 = ?", (max(now_ms, 1), row[0])
            )
            return str(row[0]), self._bump(cur)

    @staticmethod
    def _bump(cur: Cursor) -> int:
        cur.execute("UPDATE tenant_directory SET version = version + 1 WHERE id = 1")
        return int(cur.execute("SELECT version FROM tenant_directory WHERE id = 1").one()[0])

    # -- reads -----------------------------------------------------------------------------

    def version(self) -> int:
        with self.store.transaction() as cur:
            return int(cur.execute("SELECT version FROM tenant_directory WHERE id = 1").one()[0])

    def policy(self, tenant: str) -> TenantPolicy | None:
        with self.store.transaction() as cur:
            row = cur.execute(
                "SELECT policy FROM tenants WHERE tenant = ?", (check_tenant(tenant),)
            ).one()
        return None if row is None else TenantPolicy.from_json(row[0])

    def tenants(self) -> list[str]:
        with self.store.transaction() as cur:
            return sorted(r[0] for r in cur.execute("SELECT tenant FROM tenants").all())

    def keys(self, tenant: str) -> list[tuple[str, int]]:
        """(key id, created unix ms) of the tenant's live keys."""
        with self.store.transaction() as cur:
            rows = cur.execute(
                "SELECT key_id, created_ms FROM api_keys WHERE tenant = ? AND revoked_ms = 0",
                (check_tenant(tenant),),
            ).all()
        return sorted((r[0], int(r[1])) for r in rows)

    def snapshot(self) -> Snapshot:
        """One consistent read of every tenant and key (one transaction)."""
        with self.store.transaction() as cur:
            version = int(cur.execute("SELECT version FROM tenant_directory WHERE id = 1").one()[0])
            tenants = cur.execute("SELECT tenant, policy FROM tenants").all()
            keys = cur.execute(
                "SELECT key_sha256, tenant, key_id, created_ms, revoked_ms FROM api_keys"
            ).all()
        rows = [KeyRow(k[0], KeyRecord(k[1], k[2], int(k[3])), int(k[4])) for k in keys]
        return Snapshot(
            version=version,
            policies={t: TenantPolicy.from_json(p) for t, p in tenants},
            live=[r for r in rows if not r.revoked_ms],
            revoked=[r for r in rows if r.revoked_ms],
        )
