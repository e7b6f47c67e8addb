"""python -m router keys create|list|revoke --tenant T;  python -m router tenants set|list

Tenants and their API keys, kept in Redis (keys in common/mesh_state.py). A key is printed
once, when it is created; Redis keeps only its SHA-256. Run with the admin Redis user.
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
from common.tenancy import ALL_MODELS, KeyRecord, TenantPolicy, check_tenant, key_hash, new_key


class AdminSettings(BaseSettings):
    """The admin's connection; MESHSERVE_ADMIN_REDIS_PASSWORD holds its password."""

    model_config = SettingsConfigDict(env_prefix="MESHSERVE_ADMIN_")

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: SecretStr | None = None
    redis_password_file: Path | None = None


class TenantAdmin:
    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def set_tenant(self, tenant: str, policy: TenantPolicy) -> None:
        check_tenant(tenant)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(mesh_state.tenant_key(tenant), policy.to_json())
        pipe.sadd(mesh_state.TENANTS, tenant)
        pipe.execute()

    def policy(self, tenant: str) -> TenantPolicy | None:
        text = self.redis.get(mesh_state.tenant_key(check_tenant(tenant)))
        return None if text is None else TenantPolicy.from_json(text)  # type: ignore[arg-type]

    def tenants(self) -> list[str]:
        return sorted(self.redis.smembers(mesh_state.TENANTS))  # type: ignore[arg-type]

    def create_key(self, tenant: str) -> tuple[str, str]:
        """-> (key id, key); a tenant without a policy gets the default one (every model,
        no limits)."""
        if self.policy(tenant) is None:
            self.set_tenant(tenant, TenantPolicy())
        key_id, key = new_key()
        digest = key_hash(key)
        record = KeyRecord(tenant, key_id, mesh_state.now_ms())
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(mesh_state.api_key_key(digest), record.to_json())
        pipe.hset(mesh_state.tenant_keys_key(tenant), key_id, f"{digest}:{record.created_ms}")
        pipe.execute()
        return key_id, key

    def list_keys(self, tenant: str) -> list[tuple[str, int]]:
        """(key id, created unix ms) of the tenant's live keys."""
        rows: dict[str, str] = self.redis.hgetall(mesh_state.tenant_keys_key(check_tenant(tenant)))  # type: ignore[assignment]
        return sorted((k, int(v.rpartition(":")[2])) for k, v in rows.items())

    def revoke(self, tenant: str, key_id: str) -> bool:
        where = mesh_state.tenant_keys_key(check_tenant(tenant))
        value: str | None = self.redis.hget(where, key_id)  # type: ignore[assignment]
        if value is None:
            return False
        digest = value.partition(":")[0]
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(mesh_state.api_key_key(digest))
        pipe.hdel(where, key_id)
        pipe.execute()
        return True


def connect(settings: AdminSettings) -> redis.Redis:
    password = read_password(settings.redis_password, settings.redis_password_file)
    return redis_conn.connect(settings.redis_url, password=password, timeout_s=5)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--redis-url", help="redis://admin@host:port/0")
    connection.add_argument(
        "--redis-password-file", type=Path, help="else MESHSERVE_ADMIN_REDIS_PASSWORD"
    )
    sub = parser.add_subparsers(dest="what", required=True)
    keys = sub.add_parser("keys", help="API keys of a tenant", parents=[connection])
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("--tenant", required=True)
    keys.add_argument("--key-id", help="the key to revoke (from `keys list`)")
    tenants = sub.add_parser("tenants", help="tenants and their policies", parents=[connection])
    tenants.add_argument("action", choices=["set", "list"])
    tenants.add_argument("--tenant")
    tenants.add_argument("--models", default=ALL_MODELS, help="comma-separated, or '*'")
    tenants.add_argument("--rps", type=float, default=0.0, help="requests per second; 0: none")
    tenants.add_argument("--burst", type=int, default=0, help="default: one second's worth")
    tenants.add_argument("--tokens-per-minute", type=int, default=0)
    tenants.add_argument("--monthly-spend-cap-micro-usd", type=int, default=0)
    tenants.add_argument("--admin", action="store_true", help="sees prices in ModelConfig")
    args = parser.parse_args(argv)
    overrides = {
        k: v
        for k, v in (
            ("redis_url", args.redis_url),
            ("redis_password_file", args.redis_password_file),
        )
        if v is not None
    }
    admin = TenantAdmin(connect(AdminSettings(**overrides)))
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
        ).to_json()
    )  # checked as the router will read it
    admin.set_tenant(args.tenant, policy)
    print(f"tenant {args.tenant}: {policy}")
    return 0
