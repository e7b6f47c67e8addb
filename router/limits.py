"""Per-tenant rate limits and quotas, shared by every router through Redis.

Each decision is ONE Lua script, so it is atomic across any number of router processes,
and every bucket runs on Redis's clock (TIME), not on each router's:

- requests per second: a token bucket of `burst` requests refilled at the rate; a call
  takes one token or is refused;
- tokens per minute: a bucket of that many tokens refilled continuously; a call is
  admitted while the bucket is above 0 and its tokens are taken when they are known (after
  the call): a call may overdraw it, and the next ones wait until it refills;
- monthly spend cap: what the tenant was billed this UTC month (micro-USD, per call and per
  token); at or above the cap no call is admitted until the next month.

Refused: RESOURCE_EXHAUSTED naming the limit, and `retry-after` (seconds) in the trailing
metadata: when the bucket has a token again, or the first of next month. Tokens and spend are
charged in the background (`charge`, written every CHARGE_EVERY_S): the call's answer does
not wait for them. A Redis that is down does not stop the mesh: calls are admitted
(fail open, logged once per outage), as the router keeps serving from its last known
registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections import defaultdict

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from common import mesh_state
from common.errors import ResourceExhausted
from common.outage import Outage
from common.tenancy import TenantPolicy

log = structlog.get_logger()

CHARGE_EVERY_S = 0.02
SPEND_TTL_S = 40 * 86400  # a month's counter outlives its month

_REFILL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function refill(key, per_us, size)
  local v = redis.call('HMGET', key, 'level', 'at_us')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil or at == nil then return size end
  if now > at then level = math.min(size, level + (now - at) * per_us) end
  return level
end
"""

# KEYS: rps bucket, tpm bucket, spend counter. ARGV: rps, burst, tpm, spend cap.
# -> {1} admitted, or {0, limit, retry after in ms}
ADMIT = (
    _REFILL
    + """
local rps, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tpm, cap = tonumber(ARGV[3]), tonumber(ARGV[4])
if cap > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= cap then
  return {0, 'spend', 0}
end
if tpm > 0 then
  local level = refill(KEYS[2], tpm / 60e6, tpm)
  if level <= 0 then return {0, 'tpm', math.ceil((1 - level) / (tpm / 60e6) / 1000)} end
end
if rps > 0 then
  local level = refill(KEYS[1], rps / 1e6, burst)
  if level < 1 then return {0, 'rps', math.ceil((1 - level) / (rps / 1e6) / 1000)} end
  redis.call('HSET', KEYS[1], 'level', tostring(level - 1), 'at_us', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rps * 1000) + 1000)
end
return {1}
"""
)

# KEYS: tpm bucket, spend counter. ARGV: tokens, tpm, micro-USD, the counter's TTL (s).
CHARGE = (
    _REFILL
    + """
local tokens, tpm, spend = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and tokens ~= 0 then
  local level = refill(KEYS[2], tpm / 60e6, tpm) - tokens
  redis.call('HSET', KEYS[2], 'level', tostring(level), 'at_us', now)
  redis.call('PEXPIRE', KEYS[2], 120000)
end
if spend ~= 0 then
  redis.call('INCRBY', KEYS[3], spend)
  redis.call('EXPIRE', KEYS[3], ARGV[4])
end
return 1
"""
)

DESCRIBE = {
    "rps": "requests per second",
    "tpm": "tokens per minute",
    "spend": "monthly spend cap",
}


def month(now: dt.datetime | None = None) -> str:
    return (now or dt.datetime.now(dt.UTC)).strftime("%Y%m")


def seconds_to_next_month(now: dt.datetime | None = None) -> float:
    now = now or dt.datetime.now(dt.UTC)
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    following = (first + dt.timedelta(days=32)).replace(day=1)
    return (following - now).total_seconds()


class Limiter:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._admit = redis.register_script(ADMIT)
        self._charge = redis.register_script(CHARGE)
        self._pending: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # tokens, spend
        self._policies: dict[str, TenantPolicy] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.redis_state = Outage("rate_limits_redis_unreachable_admitting", "rate_limits_back")

    async def admit(self, tenant: str, policy: TenantPolicy) -> None:
        """One decision for one call; ResourceExhausted (with retry-after) when refused."""
        if not policy.limited:
            return
        keys = [
            mesh_state.limit_key(tenant, "rps"),
            mesh_state.limit_key(tenant, "tpm"),
            mesh_state.spend_key(tenant, month()),
        ]
        args: list[str | int] = [
            repr(policy.requests_per_second),
            policy.bucket_size,
            policy.tokens_per_minute,
            policy.monthly_spend_cap_micro_usd,
        ]
        try:
            verdict = await self._admit(keys=keys, args=args)
        except (RedisError, OSError) as e:
            self.redis_state.failed(e)
            return
        self.redis_state.succeeded()
        if int(verdict[0]):
            return
        limit = verdict[1].decode() if isinstance(verdict[1], bytes) else str(verdict[1])
        if limit == "spend":
            retry_s = seconds_to_next_month()
            what = f"{policy.monthly_spend_cap_micro_usd} micro-USD this month"
            resets = "at the start of next month (UTC)"
        else:
            retry_s = int(verdict[2]) / 1000
            what = (
                f"{policy.requests_per_second:g} requests per second (burst {policy.bucket_size})"
                if limit == "rps"
                else f"{policy.tokens_per_minute} tokens per minute"
            )
            resets = f"in {retry_s:.3f} s"
        raise ResourceExhausted(
            f"tenant {tenant!r} is over its {DESCRIBE[limit]}: {what}; retry {resets} "
            "(retry-after in the trailing metadata)",
            trailers=(("retry-after", f"{max(retry_s, 0.001):.3f}"), ("limit", limit)),
        )

    def charge(self, tenant: str, policy: TenantPolicy, tokens: int, micro_usd: int) -> None:
        """Take a call's tokens and spend from the tenant's buckets (soon, not now)."""
        if not (policy.tokens_per_minute or policy.monthly_spend_cap_micro_usd):
            return
        pending = self._pending[tenant]
        pending[0] += tokens
        pending[1] += micro_usd
        self._policies[tenant] = policy
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(CHARGE_EVERY_S)
            await self.flush()

    async def flush(self) -> None:
        pending, self._pending = self._pending, defaultdict(lambda: [0, 0])
        for tenant, (tokens, spend) in pending.items():
            policy = self._policies[tenant]
            keys = [
                mesh_state.limit_key(tenant, "rps"),  # unused: the script's keys are fixed
                mesh_state.limit_key(tenant, "tpm"),
                mesh_state.spend_key(tenant, month()),
            ]
            try:
                await self._charge(
                    keys=keys, args=[tokens, policy.tokens_per_minute, spend, SPEND_TTL_S]
                )
                self.redis_state.succeeded()
            except (RedisError, OSError) as e:  # kept for the next flush
                self.redis_state.failed(e)
                self._pending[tenant][0] += tokens
                self._pending[tenant][1] += spend

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self.flush()
