"""Each model's queue depth over the whole mesh, kept in Redis for an autoscaler.

KEDA's `redis` scaler reads the length of one key per ScaledObject trigger. Every worker
records its share for each model it serves (requests waiting + running; for an LLM also its
KV cache occupancy) and, in the same Lua script, resizes two lists per model to the sums
over every live share: `meshserve:scale:{model}:queue` and `meshserve:scale:{model}:kv`
(common/mesh_state.py). The script runs atomically on Redis's own clock, drops shares older
than the registry TTL (a replica that died without leaving) and lets every key expire with
that TTL, so the lengths are exact at each write and fall to 0 when no replica is left.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from common import mesh_state

# KEYS: replicas hash, queue list, kv list. ARGV: worker id, depth (-1: remove the share),
# KV percent, TTL ms. Returns {queue length, kv length}.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
if tonumber(ARGV[2]) >= 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. ARGV[3] .. ':' .. now)
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
local depth, kv = 0, 0
local shares = redis.call('HGETALL', KEYS[1])
for i = 1, #shares, 2 do
  local d, k, at = string.match(shares[i + 1], '^(%d+):(%d+):(%d+)$')
  if d == nil or now - tonumber(at) > ttl then
    redis.call('HDEL', KEYS[1], shares[i])
  else
    depth = depth + tonumber(d)
    kv = kv + tonumber(k)
  end
end
local function resize(key, n)
  if n == 0 then
    redis.call('DEL', key)
    return
  end
  local have = redis.call('LLEN', key)
  if have > n then
    redis.call('LTRIM', key, 0, n - 1)
  end
  while have < n do
    local batch = math.min(n - have, 1000)
    local items = {}
    for j = 1, batch do
      items[j] = '1'
    end
    redis.call('RPUSH', key, unpack(items))
    have = have + batch
  end
  redis.call('PEXPIRE', key, ttl)
end
resize(KEYS[2], depth)
resize(KEYS[3], kv)
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {depth, kv}
"""


@dataclass(frozen=True)
class ModelLoad:
    """One replica's share for one model."""

    depth: int  # requests (LLM: sequences) waiting + running
    kv_used: int = 0  # KV cache tokens held and the budget (LLM models; 0 and 0 otherwise)
    kv_total: int = 0

    @property
    def kv_percent(self) -> int:
        return 100 * self.kv_used // self.kv_total if self.kv_total else 0


def model_loads(models: Mapping[str, list[tuple[int, int, int]]]) -> dict[str, ModelLoad]:
    """Per model name, its versions' (depth, kv_used, kv_total) summed into one share."""
    return {
        name: ModelLoad(*(sum(column) for column in zip(*rows, strict=True)))
        for name, rows in models.items()
    }


class ScaleKeys:
    """Writes this worker's shares and the mesh-wide sums (see the module doc)."""

    def __init__(self, redis: aioredis.Redis, worker_id: str, ttl_ms: int) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self.ttl_ms = ttl_ms
        self.script = redis.register_script(_SCRIPT)

    async def publish(self, loads: Mapping[str, ModelLoad]) -> None:
        await self._run({m: (load.depth, load.kv_percent) for m, load in loads.items()})

    async def withdraw(self, models: list[str]) -> None:
        """Remove this worker's shares (it is leaving): the sums drop by them at once."""
        await self._run({m: (-1, 0) for m in models})

    async def _run(self, shares: dict[str, tuple[int, int]]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for model, (depth, kv_percent) in shares.items():
                keys = [
                    mesh_state.scale_replicas_key(model),
                    mesh_state.scale_queue_key(model),
                    mesh_state.scale_kv_key(model),
                ]
                await self.script(
                    keys, [self.worker_id, depth, kv_percent, self.ttl_ms], client=pipe
                )
            await pipe.execute()
