"""Per-call accounting: calls, successes, errors and revenue per model and version.

The request path only bumps integers in memory. A flusher writes this router's cumulative
totals to Redis every `interval_s` in one pipelined transaction, off the request path.
Absolute totals make the write idempotent: a flush retried after a lost reply counts nothing
twice, and a Redis that restarted empty is made whole by the next flush. While Redis is
unreachable the totals simply keep growing in memory.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from common import mesh_state

log = structlog.get_logger()


@dataclass
class Usage:
    calls: int = 0
    success: int = 0
    errors: int = 0
    revenue_micro_usd: int = 0


class Accounting:
    def __init__(self, redis_url: str, router_id: str, interval_s: float = 0.2) -> None:
        self.redis = aioredis.from_url(
            redis_url, socket_timeout=1.0, socket_connect_timeout=0.5, decode_responses=True
        )
        self.router_id = router_id
        self.interval_s = interval_s
        self.usage: dict[tuple[str, str], Usage] = defaultdict(Usage)
        self._version = 0  # bumped on every record
        self._flushed = 0  # the _version the last successful flush wrote
        self._redis_ok = True
        self._task: asyncio.Task | None = None

    def record(self, model: str, version: str, ok: bool, price_micro_usd: int) -> None:
        u = self.usage[(model, version)]
        u.calls += 1
        if ok:
            u.success += 1
            u.revenue_micro_usd += price_micro_usd
        else:
            u.errors += 1
        self._version += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        # Every 10th flush rewrites even unchanged totals, in case Redis restarted empty
        # between two flushes without this router noticing.
        for tick in itertools.count(1):
            await asyncio.sleep(self.interval_s)
            await self.flush(force=tick % 10 == 0)

    async def flush(self, force: bool = False) -> bool:
        """Write the totals; True when Redis holds everything recorded so far."""
        version = self._version
        if version == self._flushed and not force and self._redis_ok:
            return True
        mapping = {
            mesh_state.usage_field(model, ver, name): getattr(u, name)
            for (model, ver), u in list(self.usage.items())
            for name in mesh_state.USAGE_FIELDS
        }
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.sadd(mesh_state.ROUTERS, self.router_id)
                if mapping:
                    pipe.hset(mesh_state.usage_key(self.router_id), mapping=mapping)
                await pipe.execute()
        except (RedisError, OSError) as e:
            if self._redis_ok:
                log.warning("usage_flush_failed_keeping_in_memory", error=str(e))
            self._redis_ok = False
            return False
        if not self._redis_ok:
            log.info("usage_flush_recovered", records=version)
        self._redis_ok = True
        self._flushed = version
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush(force=True)
        await self.redis.aclose()


async def read_usage(redis: aioredis.Redis) -> dict[tuple[str, str], Usage]:
    """Totals over every router, as Redis holds them now."""
    totals: dict[tuple[str, str], Usage] = defaultdict(Usage)
    for router_id in await redis.smembers(mesh_state.ROUTERS):  # type: ignore[misc]
        fields = await redis.hgetall(mesh_state.usage_key(router_id))  # type: ignore[misc]
        for key, value in fields.items():
            model, version, name = mesh_state.parse_usage_field(key)
            u = totals[(model, version)]
            setattr(u, name, getattr(u, name) + int(value))
    return dict(totals)
