"""Per-call accounting: calls, successes, errors, revenue and upstream time per model version.

Two outputs, one flusher:

- live totals: this router's cumulative counts, HSET as absolute values (idempotent; a Redis
  that restarted empty is made whole by the next flush);
- batches for the durable ledger: every flush closes a batch with the next sequence number
  and appends it to this router's stream. The router keeps each batch until the ledger acks
  its seq, and appends again what a restarted Redis lost: the ledger applies each seq once.

A Redis that restarted empty is caught before anything new is appended: the append script
refuses when this router's stream should exist and does not, and the router then appends
every batch the ledger has not acked, oldest first, before the new ones.

Group commit: a successful call's reply waits until the batch holding its record is in Redis
(one pipelined round trip shared by every call in the batch), so a router killed after a
reply loses no count. When Redis is unreachable or slower than `wait_s`, replies do not
wait: counts stay in memory and reach Redis when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from common import mesh_state
from common.outage import Outage

log = structlog.get_logger()

TOTALS_EVERY_S = 0.2
COMMIT_DELAY_S = 0.0005

# KEYS[1]: the stream. ARGV[1]: "1" if the stream must exist already. Then (id, usage, at_ms)
# per batch. Returns the number appended, or -1 when the stream vanished (Redis restarted).
APPEND = """
if ARGV[1] == "1" and redis.call("EXISTS", KEYS[1]) == 0 then return -1 end
for i = 2, #ARGV, 3 do
  local r = redis.pcall("XADD", KEYS[1], ARGV[i], "usage", ARGV[i + 1], "at_ms", ARGV[i + 2])
  if type(r) == "table" and r.err and not string.find(r.err, "equal or smaller") then
    return redis.error_reply(r.err)
  end
end
return (#ARGV - 1) / 3
"""


@dataclass
class Usage:
    calls: int = 0
    success: int = 0
    errors: int = 0
    revenue_micro_usd: int = 0
    upstream_ns: int = 0

    def add(self, ok: bool, price: int, upstream_ns: int) -> None:
        self.calls += 1
        self.success += ok
        self.errors += not ok
        self.revenue_micro_usd += price if ok else 0
        self.upstream_ns += upstream_ns

    def as_list(self) -> list[int]:
        return [getattr(self, f) for f in mesh_state.USAGE_FIELDS]


@dataclass
class Batch:
    seq: int
    usage: dict[str, Usage] = field(default_factory=lambda: defaultdict(Usage))
    at_ms: int = 0
    durable: asyncio.Future | None = None

    def args(self) -> list[str]:
        usage = json.dumps({k: u.as_list() for k, u in self.usage.items()})
        return [f"{self.seq}-1", usage, str(self.at_ms)]


class Accounting:
    def __init__(
        self,
        redis_url: str,
        router_id: str,
        wait_s: float = 0.25,
        maintenance_s: float = 1.0,
        retain_max: int = 200_000,
        inflight: Callable[[], int] = lambda: 0,
    ) -> None:
        self.redis = aioredis.from_url(
            redis_url, socket_timeout=1.0, socket_connect_timeout=0.5, decode_responses=True
        )
        self.router_id = router_id
        self.wait_s = wait_s
        self.maintenance_s = maintenance_s
        self.retain_max = retain_max
        self.inflight = inflight
        self.totals: dict[tuple[str, str], Usage] = defaultdict(Usage)
        self._seq = 0
        self._current = self._new_batch()
        self._unsent: list[Batch] = []  # closed, not yet in Redis
        self._retained: list[Batch] = []  # in Redis, not yet acked by the ledger
        self._wake = asyncio.Event()
        self.redis_state = Outage("usage_flush_failed_keeping_in_memory", "usage_flush_recovered")
        self._stream_exists = False  # once we appended, the stream must be there
        self._totals_due = 0.0
        self._records = 0  # calls recorded so far
        self._totals_written = -1  # self._records as of the last totals write
        self._append = self.redis.register_script(APPEND)
        self._task: asyncio.Task | None = None

    def _new_batch(self) -> Batch:
        self._seq += 1
        return Batch(self._seq)

    # -- the request path ------------------------------------------------------------------

    def record(
        self, model: str, version: str, ok: bool, price_micro_usd: int, upstream_ns: int = 0
    ) -> asyncio.Future:
        """Count one call; the returned future resolves once its batch is in Redis."""
        self.totals[(model, version)].add(ok, price_micro_usd, upstream_ns)
        self._records += 1
        batch = self._current
        batch.usage[mesh_state.model_key(model, version)].add(ok, price_micro_usd, upstream_ns)
        if batch.durable is None:
            batch.durable = asyncio.get_running_loop().create_future()
        self._wake.set()
        return batch.durable

    async def durable(self, future: asyncio.Future) -> None:
        """Wait for a record to reach Redis, unless Redis is down or slow."""
        if not self.redis_state.up or future.done():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(future), self.wait_s)

    # -- the flusher -----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        next_maintenance = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TOTALS_EVERY_S)
            self._wake.clear()
            if self.inflight() > 0:
                # Other calls are about to finish: let them join this batch (a commit delay,
                # as databases do) instead of paying one Redis round trip each.
                await asyncio.sleep(COMMIT_DELAY_S)
            if time.monotonic() >= next_maintenance:
                await self._maintain()
                next_maintenance = time.monotonic() + self.maintenance_s
            await self.flush()
            if self._records != self._totals_written and time.monotonic() >= self._totals_due:
                with contextlib.suppress(RedisError, OSError):
                    await self._write_totals()

    async def flush(self) -> bool:
        """Close the current batch and write everything unsent; True when Redis has it all."""
        if self._current.usage:
            batch, self._current = self._current, self._new_batch()
            batch.at_ms = mesh_state.now_ms()
            self._unsent.append(batch)
        if not self._unsent:
            return True
        sending = list(self._unsent)
        try:
            appended = await self._send(sending)
            if appended < 0:  # Redis lost our stream: put back what the ledger has not acked
                log.warning("redis_restarted_resending_batches", batches=len(self._retained))
                self._unsent[:0] = self._retained
                self._retained = []
                self._stream_exists = False
                sending = list(self._unsent)
                await self._send(sending)
        except (RedisError, OSError) as e:
            self.redis_state.failed(e)
            self._release(sending)  # replies do not wait on a Redis that is down
            return False
        self.redis_state.succeeded(unsent=len(self._unsent))
        del self._unsent[: len(sending)]
        self._retained.extend(sending)
        if len(self._retained) > self.retain_max:
            dropped = self._retained[: len(self._retained) - self.retain_max]
            del self._retained[: len(dropped)]
            log.error("ledger_not_draining_forgetting_batches", up_to_seq=dropped[-1].seq)
        self._release(sending)
        return True

    async def _write_totals(self) -> None:
        """The live view (a few times a second at most; the batches are the exact record)."""
        written = self._records
        totals = {
            mesh_state.usage_field(model, version, name): getattr(u, name)
            for (model, version), u in list(self.totals.items())
            for name in mesh_state.USAGE_FIELDS
        }
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(mesh_state.ROUTERS, self.router_id)
            pipe.hset(mesh_state.usage_key(self.router_id), mapping=totals)
            await pipe.execute()
        self._totals_due = time.monotonic() + TOTALS_EVERY_S
        self._totals_written = written

    async def _send(self, batches: list[Batch]) -> int:
        args = ["1" if self._stream_exists else "0"]
        for b in batches:
            args += b.args()
        appended = int(
            await self._append(keys=[mesh_state.calls_stream(self.router_id)], args=args)
        )
        if appended >= 0:
            self._stream_exists = True
        return appended

    async def _maintain(self) -> None:
        """Forget the batches the ledger has committed."""
        try:
            ack = await self.redis.get(mesh_state.ledger_ack_key(self.router_id))
        except (RedisError, OSError) as e:
            self.redis_state.failed(e)
            return
        acked = int(ack) if ack else 0
        self._retained = [b for b in self._retained if b.seq > acked]

    @staticmethod
    def _release(batches: list[Batch]) -> None:
        for b in batches:
            if b.durable is not None and not b.durable.done():
                b.durable.set_result(None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()
        with contextlib.suppress(RedisError, OSError):
            await self._write_totals()
        await self.redis.aclose()


async def read_usage(redis: aioredis.Redis) -> dict[tuple[str, str], Usage]:
    """Live totals over every router, as Redis holds them now."""
    totals: dict[tuple[str, str], Usage] = defaultdict(Usage)
    for router_id in await redis.smembers(mesh_state.ROUTERS):  # type: ignore[misc]
        fields = await redis.hgetall(mesh_state.usage_key(router_id))  # type: ignore[misc]
        for key, value in fields.items():
            model, version, name = mesh_state.parse_usage_field(key)
            u = totals[(model, version)]
            setattr(u, name, getattr(u, name) + int(value))
    return dict(totals)
