"""The one Redis connection factory: its URL forms, and real connections to a redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import redis_conn
from devmesh.processes import LocalMesh


def test_sentinel_url_parts() -> None:
    t = redis_conn.parse_sentinel("redis+sentinel://router@10.0.0.1:26379,[::1]:26380/mesh/2")
    assert t.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (t.service, t.db, t.username, t.ssl, t.sentinel_auth) == (
        "mesh",
        2,
        "router",
        False,
        False,
    )
    t = redis_conn.parse_sentinel("rediss+sentinel://h:1/mesh?sentinel_auth=yes")
    assert (t.db, t.username, t.ssl, t.sentinel_auth) == (0, None, True, True)
    assert redis_conn.is_sentinel("redis+sentinel://h:1/m")
    assert not redis_conn.is_sentinel("redis://h:1/0")


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("redis+sentinel://h:1", "service_name"),
        ("redis+sentinel://h:x/mesh", "host:port"),
        ("redis+sentinel://h:1,:2/mesh", "host:port"),
        ("redis+sentinel://h:1/mesh/zero", "database"),
        ("redis+sentinel://u:secret@h:1/mesh", "no password"),
        ("redis://h:1/0", "Sentinel URL starts"),
    ],
)
def test_bad_sentinel_url_names_the_part(url: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        redis_conn.parse_sentinel(url)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    mesh = LocalMesh(tmp_path)
    mesh.start_redis()
    yield mesh.redis_url
    mesh.stop(kill=True)


def test_sync_and_async_clients_reach_one_redis(redis_url: str) -> None:
    client = redis_conn.connect(redis_url, timeout_s=2)
    client.set("meshserve:test", "sync")
    assert client.get("meshserve:test") == "sync"  # decoded by default

    async def read() -> object:
        aclient = redis_conn.connect_async(redis_url)
        try:
            return await aclient.get("meshserve:test")
        finally:
            await aclient.aclose()

    assert asyncio.run(read()) == "sync"
    assert redis_conn.connect(redis_url, decode=False).get("meshserve:test") == b"sync"
    assert redis_conn.describe("redis://router@h:1/0") == "redis://h:1/0"
