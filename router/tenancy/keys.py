"""python -m router keys create|list|revoke --tenant T;  python -m router tenants set|list|import

Tenants and their API keys. The ledger's database holds them (common/tenant_directory.py: --db, the
ledger's own); Redis holds their serving copy (keys in common/mesh_state.py). Every change
is written to the database first, then to Redis; the ledger refills a Redis that lost them.
A key is printed once, when it is created; only its SHA-256 is stored. Run with the admin
Redis user. `tenants import` copies tenants and keys that live only in Redis (made before
the database held them) into the database: run it once, before any other change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import redis
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from common import mesh_state, redis_conn
from common.redis_auth import read_password
from common.sqldb import Database
from common.tenancy import (
    ALL_MODELS,
    PRIORITIES,
    KeyRecord,
    TenantPolicy,
    check_tenant,
    key_hash,
    new_key,
)
from common.tenant_directory import TenantDirectory

# KEYS[1]: the version Redis holds. ARGV[1]: the one this change made. Redis moves to it only
# from the version just before it (else the ledger's refill brings it there).
ADVANCE = """
local have = redis.call('GET', KEYS[1])
local want = tonumber(ARGV[1])
if (not have and want == 1) or (have and tonumber(have) == want - 1) then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class AdminSettings(BaseSettings):
    """The admin's connections; MESHSERVE_ADMIN_REDIS_PASSWORD holds its password."""

    model_config = SettingsConfigDict(env_prefix="MESHSERVE_ADMIN_")

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: SecretStr | None = None
    redis_password_file: Path | None = None
    db: str = "sqlite:///build/ledger.db"  # the ledger's database: or postgresql://...


class TenantAdmin:
    def __init__(self, client: redis.Redis, directory: TenantDirectory) -> None:
        self.redis = client
        self.directory = directory
        self._advance = client.register_script(ADVANCE)

    def _check_imported(self) -> None:
        if (
            self.directory.version() == 0
            and self.redis.get(mesh_state.TENANTS_VERSION) is None
            and self.redis.scard(mesh_state.TENANTS)
        ):
            raise ValueError(
                "Redis holds tenants the database does not: run "
                "`python -m router tenants import` first"
            )

    def set_tenant(self, tenant: str, policy: TenantPolicy) -> None:
        self._check_imported()
        version = self.directory.set_tenant(tenant, policy, mesh_state.now_ms())
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(mesh_state.tenant_key(tenant), policy.to_json())
        pipe.sadd(mesh_state.TENANTS, tenant)
        pipe.execute()
        self._advance(keys=[mesh_state.TENANTS_VERSION], args=[version])

    def policy(self, tenant: str) -> TenantPolicy | None:
        return self.directory.policy(tenant)

    def tenants(self) -> list[str]:
        return self.directory.tenants()

    def create_key(self, tenant: str) -> tuple[str, str]:
        """-> (key id, key); a tenant without a policy gets the default one (every model,
        no limits)."""
        if self.policy(tenant) is None:
            self.set_tenant(tenant, TenantPolicy())
        key_id, key = new_key()
        digest = key_hash(key)
        record = KeyRecord(tenant, key_id, mesh_state.now_ms())
        version = self.directory.add_key(digest, record)
        self.redis.set(mesh_state.api_key_key(digest), record.to_json())
        self._advance(keys=[mesh_state.TENANTS_VERSION], args=[version])
        return key_id, key

    def list_keys(self, tenant: str) -> list[tuple[str, int]]:
        """(key id, created unix ms) of the tenant's live keys."""
        return self.directory.keys(tenant)

    def revoke(self, tenant: str, key_id: str) -> bool:
        revoked = self.directory.revoke(tenant, key_id, mesh_state.now_ms())
        if revoked is None:
            return False
        digest, version = revoked
        self.redis.delete(mesh_state.api_key_key(digest))
        self._advance(keys=[mesh_state.TENANTS_VERSION], args=[version])
        return True

    def import_from_redis(self) -> tuple[int, int]:
        """Copy the tenants and keys Redis holds (and the database does not) into the
        database -> (tenants, keys) copied."""
        have = set(self.directory.tenants())
        copied = [0, 0]
        for tenant in sorted(self.redis.smembers(mesh_state.TENANTS)):  # type: ignore[arg-type]
            text = self.redis.get(mesh_state.tenant_key(check_tenant(tenant)))
            if tenant not in have and text is not None:
                self.directory.set_tenant(tenant, TenantPolicy.from_json(text), mesh_state.now_ms())  # type: ignore[arg-type]
                copied[0] += 1
            known = {k for k, _ in self.directory.keys(tenant)}
            rows: dict[str, str] = self.redis.hgetall(mesh_state.tenant_keys_key(tenant))  # type: ignore[assignment]
            for key_id, value in sorted(rows.items()):
                digest = value.partition(":")[0]
                record_text = self.redis.get(mesh_state.api_key_key(digest))
                if key_id in known or record_text is None:
                    continue
                self.directory.add_key(digest, KeyRecord.from_json(record_text))  # type: ignore[arg-type]
                copied[1] += 1
        return copied[0], copied[1]


def connect(settings: AdminSettings) -> TenantAdmin:
    password = read_password(settings.redis_password, settings.redis_password_file)
    client = redis_conn.connect(settings.redis_url, password=password, timeout_s=5)
    return TenantAdmin(client, TenantDirectory(Database(settings.db)))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--redis-url", help="redis://admin@host:port/0")
    connection.add_argument(
        "--redis-password-file", type=Path, help="else MESHSERVE_ADMIN_REDIS_PASSWORD"
    )
    connection.add_argument("--db", help="the ledger's database (default: build/ledger.db)")
    sub = parser.add_subparsers(dest="what", required=True)
    keys = sub.add_parser("keys", help="API keys of a tenant", parents=[connection])
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("--tenant", required=True)
    keys.add_argument("--key-id", help="the key to revoke (from `keys list`)")
    tenants = sub.add_parser("tenants", help="tenants and their policies", parents=[connection])
    tenants.add_argument("action", choices=["set", "list", "import"])
    tenants.add_argument("--tenant")
    tenants.add_argument("--models", default=ALL_MODELS, help="comma-separated, or '*'")
    tenants.add_argument("--rps", type=float, default=0.0, help="requests per second; 0: none")
    tenants.add_argument("--burst", type=int, default=0, help="default: one second's worth")
    tenants.add_argument("--tokens-per-minute", type=int, default=0)
    tenants.add_argument("--monthly-spend-cap-micro-usd", type=int, default=0)
    tenants.add_argument("--admin", action="store_true", help="sees prices in ModelConfig")
    tenants.add_argument(
        "--priority",
        choices=sorted(PRIORITIES),
        default="normal",
        help="under overload, lower classes are shed first (router/forwarding/shedding.py)",
    )
    tenants.add_argument(
        "--weight", type=float, default=1.0, help="its share of an engine (fair admission)"
    )
    args = parser.parse_args(argv)
    overrides = {
        k: v
        for k, v in (
            ("redis_url", args.redis_url),
            ("redis_password_file", args.redis_password_file),
            ("db", args.db),
        )
        if v is not None
    }
    admin = connect(AdminSettings(**overrides))
    try:
        if args.what == "tenants":
            return _tenants(admin, args)
        if args.action == "create":
            key_id, key = admin.create_key(args.tenant)
            print(f"tenant {args.tenant} key {key_id} (shown once, keep it secret):")
            print(key)
        elif args.action == "list":
            for key_id, created in admin.list_keys(args.tenant):
                print(f"{key_id}  created_ms={created}")
        else:
            if not args.key_id:
                parser.error("keys revoke needs --key-id")
            if not admin.revoke(args.tenant, args.key_id):
                print(f"tenant {args.tenant} has no key {args.key_id}", file=sys.stderr)
                return 1
            print(f"revoked key {args.key_id} of tenant {args.tenant}")
    except ValueError as e:
        print(f"meshserve router: {e}", file=sys.stderr)
        return 2
    return 0


def _tenants(admin: TenantAdmin, args: argparse.Namespace) -> int:
    if args.action == "list":
        for tenant in admin.tenants():
            print(f"{tenant}  {admin.policy(tenant)}")
        return 0
    if args.action == "import":
        tenants, keys = admin.import_from_redis()
        print(f"copied {tenants} tenants and {keys} keys from Redis into the database")
        return 0
    if not args.tenant:
        raise ValueError("tenants set needs --tenant")
    policy = TenantPolicy.from_json(
        TenantPolicy(
            models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
            requests_per_second=args.rps,
            burst=args.burst,
            tokens_per_minute=args.tokens_per_minute,
            monthly_spend_cap_micro_usd=args.monthly_spend_cap_micro_usd,
            admin=args.admin,
            priority=args.priority,
            weight=args.weight,
        ).to_json()
    )  # checked as the router will read it
    admin.set_tenant(args.tenant, policy)
    print(f"tenant {args.tenant}: {policy}")
    return 0
