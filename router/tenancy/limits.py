"""Per-tenant rate limits and quotas, shared by every router through Redis, decided locally.

The buckets live in Redis, on Redis's clock (TIME), and are the one source of truth:

- requests per second: a token bucket of `burst` requests refilled at the rate;
- tokens per minute: a bucket of that many tokens refilled continuously; calls are admitted
  while it is above 0 and their tokens are taken when they are known (after the call): a
  call may overdraw it, and the next ones wait until it refills;
- monthly spend cap: what the tenant was billed this UTC month (micro-USD, per call and per
  token); at or above the cap no call is admitted until the next month.

A Redis round trip per call (0.3-0.6 ms here) would cost more than the whole auth path may
add, so each router process holds a *lease* per tenant and decides from it without Redis:

- a lease is requests-per-second tokens taken from the shared bucket by ONE Lua script
  (atomic across routers), sized to about LEASE_S of this process's recent demand and never
  more than L = max(1, rps x LEASE_S) tokens (nor the burst); a call takes one locally;
- it is renewed in the background once half of it is used (or it is half its life old), so
  a call normally makes no round trip; a call that finds the lease empty waits for a renewal;
- its tokens are good for LEASE_TTL_S: then what is left goes back to the bucket (with the
  next renewal, or the sweep every LEASE_TTL_S, or when the router stops); a router that
  dies loses at most L tokens, which the bucket refills within L / rps;
- the same script answers the tokens-per-minute and spend verdicts, and a refusal (with its
  reset time) is kept locally until it resets or LEASE_TTL_S passes, whichever is first, so
  a tenant over its limit costs one Redis call per LEASE_TTL_S per process, not one a call.

What this costs in exactness, with N router processes: no call is admitted without a token
taken from the shared bucket, so the admitted calls up to time T never exceed the bucket's
own ceiling (burst + rps x T). Over any window, at most N x L calls more than the bucket
allows in that window (tokens leased before it, used in it); and at most N x L tokens sit
unused in leases while another process is refused, for at most LEASE_TTL_S. Tokens per
minute and spend are seen as of this process's last script (a renewal, at least every
LEASE_TTL_S / 2 while calls come, or its own charges, every CHARGE_EVERY_S): calls admitted
in that staleness window are still charged in full, so the tenant waits longer after (tpm)
or is billed past its cap by at most those calls (spend).

Refused: RESOURCE_EXHAUSTED naming the limit, and `retry-after` (seconds) and `limit` in the
trailing metadata (on a stream, in that request's error response's parameters): when the
bucket has a token again, or the first of next month. Tokens and spend are
charged in the background (`charge`, written every CHARGE_EVERY_S): the call's answer does
not wait for them. A Redis that is down does not stop the mesh: calls are admitted
(fail open, logged once per outage), as the router keeps serving from its last known
registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import time
from collections import defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from common import mesh_state
from common.errors import ResourceExhausted
from common.outage import Outage
from common.tenancy import TenantPolicy
from router.tenancy.limit_scripts import (  # LEASE: benchmarks/auth_path.py reads it here
    CHARGE,
    LEASE,
)

log = structlog.get_logger()

CHARGE_EVERY_S = 0.02
SPEND_TTL_S = 40 * 86400  # a month's counter outlives its month
LEASE_S = 0.1  # a lease holds about this long's worth of this process's calls (at most rps x)
LEASE_TTL_S = 0.5  # its tokens are used within this, or go back to the bucket
MAX_TRIES = 8  # renewals one call waits for before it counts itself refused

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


def lease_limit(policy: TenantPolicy) -> int:
    """L: the most requests-per-second tokens one process holds for a tenant."""
    if not policy.requests_per_second:
        return 0
    return min(policy.bucket_size, max(1, int(policy.requests_per_second * LEASE_S)))


@dataclass
class _Lease:
    """One tenant's lease in this process, and the verdicts Redis gave with it."""

    tokens: int = 0  # requests this process may admit without asking Redis
    until: float = 0.0  # monotonic: the tokens and the view are good until then
    granted: int = 0  # the last renewal's tokens (half used: renew)
    taken_at: float = 0.0  # when the last renewal was sent
    asked: int = 0  # calls since then (the demand the next lease is sized by)
    refused: str = ""  # the limit the tenant is over ('': none known)
    refused_until: float = 0.0  # monotonic: refused locally until then
    resets_at: float = 0.0  # monotonic: when that limit resets (retry-after)
    renewing: asyncio.Task | None = None

    def refuse(self, limit: str, retry_s: float, now: float) -> None:
        self.refused = limit
        self.resets_at = now + retry_s
        self.refused_until = now + min(retry_s, LEASE_TTL_S)


class Limiter:
    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._lease = redis.register_script(LEASE)
        self._charge = redis.register_script(CHARGE)
        self._pending: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # tokens, spend
        self._policies: dict[str, TenantPolicy] = {}
        self._leases: dict[str, _Lease] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.redis_state = Outage("rate_limits_redis_unreachable_admitting", "rate_limits_back")

    # -- the request path ------------------------------------------------------------------

    async def admit(self, tenant: str, policy: TenantPolicy) -> None:
        """One decision for one call, from this process's lease; ResourceExhausted (with
        retry-after) when refused. Waits for Redis only when the lease is empty or stale."""
        if not policy.limited:
            return
        self._policies[tenant] = policy
        lease = self._leases.get(tenant)
        if lease is None:
            lease = self._leases[tenant] = _Lease()
        lease.asked += 1
        for _ in range(MAX_TRIES):
            if self._decide(tenant, policy, lease, time.monotonic()):
                return
            if not await self._renewed(tenant, policy, lease):
                return  # Redis is down: admitted (fail open)
        # every renewal's tokens went to this process's other calls: over the rate
        raise _refusal(tenant, policy, "rps", 1 / (policy.requests_per_second or 1))

    def _decide(self, tenant: str, policy: TenantPolicy, lease: _Lease, now: float) -> bool:
        """True: admitted locally; False: ask Redis first; raises if refused."""
        rps = policy.requests_per_second
        if (
            lease.refused
            and now < lease.refused_until
            and (lease.refused != "rps" or lease.tokens < 1)
        ):
            raise _refusal(tenant, policy, lease.refused, lease.resets_at - now)
        if now >= lease.until or (rps and lease.tokens < 1):
            return False
        if rps:
            lease.tokens -= 1
        bucket_empty = lease.refused == "rps" and now < lease.refused_until
        half_used = rps and 2 * lease.tokens <= lease.granted
        if (
            lease.renewing is None
            and not bucket_empty  # the call after the last token renews, when one is due
            and (half_used or now >= lease.until - LEASE_TTL_S / 2)
        ):
            lease.renewing = asyncio.get_running_loop().create_task(
                self._renew(tenant, policy, lease)
            )
        return True

    async def _renewed(self, tenant: str, policy: TenantPolicy, lease: _Lease) -> bool:
        """Wait for the renewal in flight, or make one; False when Redis did not answer."""
        if lease.renewing is None:
            lease.renewing = asyncio.get_running_loop().create_task(
                self._renew(tenant, policy, lease)
            )
        return await asyncio.shield(lease.renewing)

    async def _renew(self, tenant: str, policy: TenantPolicy, lease: _Lease) -> bool:
        """One LEASE script: give back an expired lease's rest, take new tokens (sized by
        the demand since the last renewal), and learn the tenant's verdicts."""
        try:
            now = time.monotonic()
            back = 0
            if now >= lease.until:
                back, lease.tokens = lease.tokens, 0
            want = 0
            if policy.requests_per_second:
                rate = lease.asked / max(now - lease.taken_at, 0.001)
                want = min(math.ceil(rate * LEASE_S), lease_limit(policy)) - lease.tokens
                want = max(want, 1 if lease.tokens < 1 else 0)
            lease.taken_at, lease.asked = now, 0
            try:
                verdict = await self._lease(keys=_keys(tenant), args=_args(policy, want, back))
            except (RedisError, OSError) as e:
                self.redis_state.failed(e)
                return False
            self.redis_state.succeeded()
            answered = time.monotonic()
            granted = int(verdict[3])
            lease.tokens += granted
            lease.granted = granted or lease.granted
            lease.until = now + LEASE_TTL_S
            limit = _text(verdict[1])  # admitted with 'rps': once these tokens are used
            if limit:
                retry_s = seconds_to_next_month() if limit == "spend" else int(verdict[2]) / 1000
                lease.refuse(limit, retry_s, answered)
            else:
                lease.refused = ""
            return True
        finally:
            lease.renewing = None

    def charge(self, tenant: str, policy: TenantPolicy, tokens: int, micro_usd: int) -> None:
        """Take a call's tokens and spend from the tenant's buckets (soon, not now)."""
        if not (policy.tokens_per_minute or policy.monthly_spend_cap_micro_usd):
            return
        pending = self._pending[tenant]
        pending[0] += tokens
        pending[1] += micro_usd
        self._policies[tenant] = policy
        self._wake.set()

    # -- the background --------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._charging()), loop.create_task(self._sweeping())]

    async def _charging(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(CHARGE_EVERY_S)
            await self.flush()

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S)
            await self.give_back(expired_only=True)

    async def flush(self) -> None:
        """Write the pending charges; a tenant they put over its tokens per minute or its
        spend cap is refused locally from now on (until the limit resets)."""
        pending, self._pending = self._pending, defaultdict(lambda: [0, 0])
        for tenant, (tokens, spend) in pending.items():
            policy = self._policies[tenant]
            keys = _keys(tenant)[1:]
            args = [
                tokens,
                policy.tokens_per_minute,
                spend,
                SPEND_TTL_S,
                policy.monthly_spend_cap_micro_usd,
            ]
            try:
                wait_ms, over = await self._charge(keys=keys, args=args)
                self.redis_state.succeeded()
            except (RedisError, OSError) as e:  # kept for the next flush
                self.redis_state.failed(e)
                self._pending[tenant][0] += tokens
                self._pending[tenant][1] += spend
                continue
            lease = self._leases.get(tenant)
            if lease is not None and int(over):
                lease.refuse("spend", seconds_to_next_month(), time.monotonic())
            elif lease is not None and int(wait_ms) >= 0:
                lease.refuse("tpm", int(wait_ms) / 1000, time.monotonic())

    async def give_back(self, expired_only: bool = False) -> None:
        """Return leased tokens to their buckets (only expired leases', when asked), and
        forget the leases that hold nothing."""
        now = time.monotonic()
        for tenant, lease in list(self._leases.items()):
            if lease.renewing is not None or (expired_only and now < lease.until):
                continue
            if lease.tokens > 0:
                back, lease.tokens = lease.tokens, 0
                args = _args(self._policies[tenant], 0, back)
                try:
                    await self._lease(keys=_keys(tenant), args=args)
                except (RedisError, OSError) as e:  # lost: the bucket refills them
                    self.redis_state.failed(e)
            idle = lease.renewing is None and lease.tokens == 0
            if idle and now >= lease.refused_until and now >= lease.until:
                del self._leases[tenant]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self.flush()
        await self.give_back()


def _keys(tenant: str) -> list[str]:
    return [
        mesh_state.limit_key(tenant, "rps"),
        mesh_state.limit_key(tenant, "tpm"),
        mesh_state.spend_key(tenant, month()),
    ]


def _args(policy: TenantPolicy, want: int, back: int) -> list[str | int]:
    return [
        repr(policy.requests_per_second),
        policy.bucket_size,
        policy.tokens_per_minute,
        policy.monthly_spend_cap_micro_usd,
        want,
        back,
    ]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _refusal(tenant: str, policy: TenantPolicy, limit: str, retry_s: float) -> ResourceExhausted:
    if limit == "spend":
        what = f"{policy.monthly_spend_cap_micro_usd} micro-USD this month"
        resets = "at the start of next month (UTC)"
    else:
        what = (
            f"{policy.requests_per_second:g} requests per second (burst {policy.bucket_size})"
            if limit == "rps"
            else f"{policy.tokens_per_minute} tokens per minute"
        )
        resets = f"in {max(retry_s, 0.001):.3f} s"
    return ResourceExhausted(
        f"tenant {tenant!r} is over its {DESCRIBE[limit]}: {what}; retry {resets} "
        "(retry-after in the trailing metadata; on a stream, in the error response's parameters)",
        trailers=(("retry-after", f"{max(retry_s, 0.001):.3f}"), ("limit", limit)),
    )
