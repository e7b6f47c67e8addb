"""The one way a meshserve process connects to Redis: a URL -> a sync or asyncio client.

URLs (the user in the URL, the password handed in separately: common/redis_auth.py):

- ``redis://[user@]host:port/db``: one Redis;
- ``rediss://[user@]host:port/db?ssl_ca_certs=/path/ca.pem``: one Redis over TLS (redis-py's
  query options: ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``);
- ``unix:///path/redis.sock?db=0``: a local socket;
- ``redis+sentinel://[user@]host:port,host:port,.../service_name[/db]``: the primary that
  Redis Sentinel names for ``service_name``, found through any of the sentinels, and found
  again after a failover (``rediss+sentinel://`` for TLS to the Redis servers). The user and
  password are the Redis servers'; the sentinels are asked without them (``?sentinel_auth=yes``:
  with the same user and password).

After a failover a connection to the old primary fails (it is gone, or it answers READONLY
as a replica); redis-py's Sentinel pool then asks the sentinels again, so the next command
goes to the new primary. Scripts are run with EVALSHA and loaded again where the server
does not know them (redis-py's ``Script``), so they survive a failover too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed Sentinel URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    ssl: bool = False
    sentinel_auth: bool = False


def is_sentinel(url: str) -> bool:
    return url.partition("://")[0] in SENTINEL_SCHEMES


def parse_sentinel(url: str) -> SentinelTarget:
    """redis+sentinel://[user@]h:p,h:p/service[/db] -> its parts; ValueError names the part
    that is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"a Sentinel URL starts {' or '.join(SENTINEL_SCHEMES)}://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"Sentinel URL: {item[:64]!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("Sentinel URL: expected /service_name or /service_name/db after the hosts")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"Sentinel URL: the database {path[1][:16]!r} is not a number")
    if ":" in userinfo:
        raise ValueError("Sentinel URL: no password in the URL (use the password file)")
    query = parse_qs(parts.query)
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(userinfo) or None,
        ssl=parts.scheme.startswith("rediss"),
        sentinel_auth=query.get("sentinel_auth", ["no"])[0] in ("1", "yes", "true"),
    )


def _options(
    password: str | None, timeout_s: float, connect_timeout_s: float | None, decode: bool
) -> dict[str, Any]:
    return {
        "password": password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": connect_timeout_s if connect_timeout_s is not None else timeout_s,
        "decode_responses": decode,
    }


def _sentinel_args(target: SentinelTarget, options: dict[str, Any]) -> dict[str, Any]:
    sentinel_kwargs = {
        "socket_timeout": options["socket_timeout"],
        "socket_connect_timeout": options["socket_connect_timeout"],
    }
    if target.sentinel_auth:
        sentinel_kwargs |= {"username": target.username, "password": options["password"]}
    return {
        "sentinels": list(target.sentinels),
        "sentinel_kwargs": sentinel_kwargs,
        "username": target.username,
        "db": target.db,
        "ssl": target.ssl,
        **options,
    }


def connect(
    url: str,
    *,
    password: str | None = None,
    timeout_s: float = 5.0,
    connect_timeout_s: float | None = None,
    decode: bool = True,
) -> redis.Redis:
    """A blocking client (admin CLI, ledger, launcher, benchmarks)."""
    options = _options(password, timeout_s, connect_timeout_s, decode)
    if is_sentinel(url):
        target = parse_sentinel(url)
        sentinel = redis.sentinel.Sentinel(**_sentinel_args(target, options))
        return sentinel.master_for(target.service)
    return redis.Redis.from_url(url, **options)


def connect_async(
    url: str,
    *,
    password: str | None = None,
    timeout_s: float = 1.0,
    connect_timeout_s: float | None = 0.5,
    decode: bool = True,
) -> aioredis.Redis:
    """An asyncio client (router, worker registration, loadtest)."""
    options = _options(password, timeout_s, connect_timeout_s, decode)
    if is_sentinel(url):
        target = parse_sentinel(url)
        sentinel = aiosentinel.Sentinel(**_sentinel_args(target, options))
        return sentinel.master_for(target.service)
    return aioredis.from_url(url, **options)


def describe(url: str) -> str:
    """The URL without its user, for logs."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
