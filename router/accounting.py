"""Per-call accounting: calls, successes, errors, revenue and upstream time per model version,
and for LLM models the tokens in and out, their revenue and how the calls finished.

Two outputs, one flusher:

- live totals: this router's cumulative counts, HSET as absolute values (idempotent; a Redis
  that restarted empty is made whole by the next flush);
- batches for the durable ledger: every flush closes a batch and appends it to this router's
  stream with the id `{epoch}-{seq}`: `epoch` is the unix ms this router process started
  (raised above whatever its id already holds in Redis), `seq` counts 1, 2, 3... within the
  process. A router restarted with the same id therefore appends above everything its
  previous process wrote, and the ledger, which applies ids above its cursor, counts both.
  The router keeps each batch until the ledger acks its id, and appends again what a
  restarted Redis lost: the ledger applies each id once.

A Redis that lost this router's last batch is caught before anything new is appended (it
restarted empty or from an old AOF, or a replica that lagged took over): the append script
refuses when the batch appended last is neither in the stream nor acked, and the router appends
every batch the ledger has not acked, oldest first, before the new ones. An id at or below
the stream's last one is skipped only when Redis already holds that very batch (a resend
after a lost reply) or the ledger has acked it; anything else is an error, never a silent
success: the batch stays in memory and the error is logged.

Group commit: a successful call's reply waits until the batch holding its record is in Redis
(one pipelined round trip shared by every call in the batch), so a router killed after a
reply loses no count. When Redis is unreachable or slower than `wait_s`, what happens is
the router's choice (`--accounting-when-slow`):

- `answer` (the default): the reply is sent anyway; the record stays in the router's memory
  and reaches Redis when it is back (lost only if the router dies first). Each such reply
  is counted in `meshserve_router_replies_before_durable_total`.
- `unavailable`: the call is answered UNAVAILABLE and recorded as an error, not billed.

A call the router answered OK but whose client was gone by then (cancelled, or its deadline
passed as the reply crossed the wire) is refunded: a later batch moves it from success to
errors, so the ledger counts what the clients received.

Tokens: a model priced per token (see `token_revenue`) bills a call's prompt and completion
tokens. A unary call records them with the call. A streamed call records them piece by
piece as they are forwarded (`record_tokens`: the piece waits for its record to be in
Redis, as a reply does), and the call itself (success with its finish reason, or error) once
it ends; a piece whose delivery failed after its record is refunded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from redis.exceptions import RedisError

from common import mesh_state, redis_conn
from common.outage import Outage
from router.usage import (  # re-exported: the names callers know from here
    FINISHED,
    NO_TOKENS,
    Receipt,
    Tokens,
    Usage,
    read_usage,
    token_revenue,
)

log = structlog.get_logger()

__all__ = [
    "FINISHED",
    "NO_TOKENS",
    "Accounting",
    "Batch",
    "Receipt",
    "Tokens",
    "Usage",
    "read_usage",
    "token_revenue",
]

TOTALS_EVERY_S = 0.2
WHEN_SLOW = ("answer", "unavailable")
COMMIT_DELAY_S = 0.0005

# KEYS[1]: the stream, KEYS[2]: the ledger's ack. ARGV[1]: the id this router appended last
# ("" before its first append). Then (id, usage, at_ms) per batch. Returns the number of
# batches now in Redis, or -1 when Redis lost what this router appended last (neither in the
# stream nor acked: a restart without it, an old AOF, a failover to a replica that lagged).
# An id at or below the stream's last one is skipped only when that entry is there already
# (a resend) or the ledger acked it; else the script fails, so no count is ever reported as
# written when it was not.
APPEND = """
local function parse(id)
  local ms, seq = string.match(id, "^(%d+)-(%d+)$")
  if ms == nil then ms, seq = string.match(id, "^(%d+)$"), "1" end
  return tonumber(ms), tonumber(seq)
end
local function le(a_ms, a_seq, b_ms, b_seq)
  return a_ms < b_ms or (a_ms == b_ms and a_seq <= b_seq)
end
local function acked(id)
  local ack = redis.call("GET", KEYS[2])
  if not ack then return false end
  local id_ms, id_seq = parse(id)
  local ack_ms, ack_seq = parse(ack)
  return ack_ms ~= nil and le(id_ms, id_seq, ack_ms, ack_seq)
end
if ARGV[1] ~= "" and #redis.call("XRANGE", KEYS[1], ARGV[1], ARGV[1], "COUNT", 1) == 0
    and not acked(ARGV[1]) then
  return -1
end
for i = 2, #ARGV, 3 do
  local r = redis.pcall("XADD", KEYS[1], ARGV[i], "usage", ARGV[i + 1], "at_ms", ARGV[i + 2])
  if type(r) == "table" and r.err then
    if not string.find(r.err, "equal or smaller") then return redis.error_reply(r.err) end
    local there = redis.call("XRANGE", KEYS[1], ARGV[i], ARGV[i], "COUNT", 1)
    if #there == 0 and not acked(ARGV[i]) then
      return redis.error_reply("BATCHID " .. ARGV[i] .. " is at or below the last id of " ..
        KEYS[1] .. " and is neither there nor acked: is another router using this id?")
    end
  end
end
return (#ARGV - 1) / 3
"""


@dataclass
class Batch:
    seq: int
    usage: dict[str, Usage] = field(default_factory=lambda: defaultdict(Usage))
    at_ms: int = 0
    durable: asyncio.Future | None = None
    epoch: int = 0  # set when the batch closes

    @property
    def id(self) -> tuple[int, int]:
        return (self.epoch, self.seq)

    def args(self) -> list[str]:
        usage = json.dumps({k: u.as_list() for k, u in self.usage.items()})
        return [f"{self.epoch}-{self.seq}", usage, str(self.at_ms)]


def parse_batch_id(text: str) -> tuple[int, int]:
    """ "{epoch}-{seq}" -> (epoch, seq); a bare "{n}" (the ack of a ledger that predates
    epochs, whose ids were "{n}-1") -> (n, 1)."""
    epoch, _, seq = text.partition("-")
    return int(epoch), int(seq or 1)


class Accounting:
    def __init__(
        self,
        redis_url: str,
        router_id: str,
        wait_s: float = 0.25,
        when_slow: str = "answer",
        maintenance_s: float = 1.0,
        retain_max: int = 200_000,
        inflight: Callable[[], int] = lambda: 0,
        password: str | None = None,
    ) -> None:
        self.redis = redis_conn.connect_async(
            redis_url, password=password, timeout_s=1.0, connect_timeout_s=0.5
        )
        # tenant, tokens, micro-USD of each billed call (and negative for a refund): the
        # tenant's tokens-per-minute and spend cap (router/auth.py)
        self.charge: Callable[[str, int, int], None] | None = None
        self.router_id = router_id
        self.wait_s = wait_s
        if when_slow not in WHEN_SLOW:
            raise ValueError(f"when_slow must be one of {WHEN_SLOW}, not {when_slow!r}")
        self.when_slow = when_slow
        self.epoch = mesh_state.now_ms()  # raised above Redis's last id before the first append
        self._epoch_checked = False
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
        self._last_appended = ""  # Redis must hold it (or its ack) at the next append
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
        self,
        model: str,
        version: str,
        ok: bool,
        price_micro_usd: int,
        upstream_ns: int = 0,
        tokens: Tokens = NO_TOKENS,
        finish: str | None = None,
        tenant: str = "",
    ) -> asyncio.Future:
        """Count one call (of `tenant`, "" with auth off); the returned future resolves once
        its batch is in Redis."""
        self.totals[(model, version)].add(ok, price_micro_usd, upstream_ns, tokens, finish)
        batch = self._current
        key = mesh_state.model_key(model, version, tenant)
        batch.usage[key].add(ok, price_micro_usd, upstream_ns, tokens, finish)
        self._charge(tenant, tokens, price_micro_usd if ok else 0)
        return self._recorded(batch)

    def record_tokens(
        self, model: str, version: str, tokens: Tokens, tenant: str = ""
    ) -> asyncio.Future:
        """Count the tokens of one streamed piece (the call is counted when it ends)."""
        self.totals[(model, version)].add_tokens(tokens)
        batch = self._current
        batch.usage[mesh_state.model_key(model, version, tenant)].add_tokens(tokens)
        self._charge(tenant, tokens, 0)
        return self._recorded(batch)

    def _charge(self, tenant: str, tokens: Tokens, price: int, sign: int = 1) -> None:
        if tenant and self.charge is not None:
            count = tokens.prompt + tokens.completion if sign > 0 else 0  # tokens were used
            spend = sign * (price + tokens.revenue_micro_usd)
            if count or spend:
                self.charge(tenant, count, spend)

    def _recorded(self, batch: Batch) -> asyncio.Future:
        self._records += 1
        if batch.durable is None:
            batch.durable = asyncio.get_running_loop().create_future()
        self._wake.set()
        return batch.durable

    def refund(self, receipt: Receipt) -> None:
        """Turn one recorded success into an error (its client never got the reply)."""
        self.totals[(receipt.model, receipt.version)].refund(receipt)
        self._records += 1
        key = mesh_state.model_key(receipt.model, receipt.version, receipt.tenant)
        self._current.usage[key].refund(receipt)
        self._charge(receipt.tenant, receipt.tokens, receipt.price_micro_usd * receipt.call, -1)
        self._wake.set()

    async def durable(self, future: asyncio.Future) -> bool:
        """Wait (at most `wait_s`) for a record to reach Redis; True once it has."""
        if future.done():
            return future.result() is True
        if self.redis_state.up:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(future), self.wait_s) is True
        return False

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
            if not self._epoch_checked:
                await self._check_epoch()
            appended = await self._send(sending)
            if appended < 0:  # Redis lost our last batch: put back what the ledger has not acked
                log.warning("redis_restarted_resending_batches", batches=len(self._retained))
                self._unsent[:0] = self._retained
                self._retained = []
                self._last_appended = ""
                sending = list(self._unsent)
                await self._send(sending)
        except (RedisError, OSError) as e:
            if "BATCHID" in str(e):
                log.error("batch_append_refused", router=self.router_id, error=str(e))
            self.redis_state.failed(e)
            self._release(sending, False)  # replies do not wait on a Redis that is down
            return False
        self.redis_state.succeeded(unsent=len(self._unsent))
        del self._unsent[: len(sending)]
        self._retained.extend(sending)
        if len(self._retained) > self.retain_max:
            dropped = self._retained[: len(self._retained) - self.retain_max]
            del self._retained[: len(dropped)]
            log.error("ledger_not_draining_forgetting_batches", up_to=dropped[-1].id)
        self._release(sending, True)
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

    async def _check_epoch(self) -> None:
        """Before the first append: this process's epoch must be above every id this router
        id already has in Redis (a clock set back, a restart within the same ms)."""
        stream = mesh_state.calls_stream(self.router_id)
        last = await self.redis.xrevrange(stream, count=1)
        ack = await self.redis.get(mesh_state.ledger_ack_key(self.router_id))
        seen = [0]
        if last:
            seen.append(parse_batch_id(last[0][0])[0])
        if ack:
            seen.append(parse_batch_id(ack)[0])
        highest = max(seen)
        if highest >= self.epoch:
            log.warning("router_epoch_raised", router=self.router_id, seen=highest)
            self.epoch = highest + 1
        for b in self._unsent:  # none of them was appended yet
            b.epoch = self.epoch
        self._epoch_checked = True

    async def _send(self, batches: list[Batch]) -> int:
        args = [self._last_appended]
        for b in batches:
            b.epoch = b.epoch or self.epoch
            args += b.args()
        keys = [
            mesh_state.calls_stream(self.router_id),
            mesh_state.ledger_ack_key(self.router_id),
        ]
        appended = int(await self._append(keys=keys, args=args))
        if appended >= 0 and batches:
            self._last_appended = f"{batches[-1].epoch}-{batches[-1].seq}"
        return appended

    async def _maintain(self) -> None:
        """Forget the batches the ledger has committed."""
        try:
            ack = await self.redis.get(mesh_state.ledger_ack_key(self.router_id))
        except (RedisError, OSError) as e:
            self.redis_state.failed(e)
            return
        acked = parse_batch_id(ack) if ack else (0, 0)
        self._retained = [b for b in self._retained if b.id > acked]

    @staticmethod
    def _release(batches: list[Batch], durable: bool) -> None:
        for b in batches:
            if b.durable is not None and not b.durable.done():
                b.durable.set_result(durable)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()
        with contextlib.suppress(RedisError, OSError):
            await self._write_totals()
        await self.redis.aclose()
