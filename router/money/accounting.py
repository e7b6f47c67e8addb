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

Group commit (`--accounting-commit before-reply`, the default): a successful call's reply
waits until the batch holding its record is in Redis (one round trip shared by every call in
the batch: whatever is recorded while one append is under way goes in the next, at once), so
a router killed after a reply loses no count. `after-reply` answers at once and the record
follows in the next group commit, a round trip later: a router killed with -9 loses the
records not in Redis yet, at most `max_unwritten` (beyond that many, replies wait as with
`before-reply`); a router stopped with SIGTERM loses nothing (it writes its last batch).
When Redis is unreachable or slower than `wait_s`, what happens is the router's choice
(`--accounting-when-slow`):

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
import time
from collections import defaultdict
from collections.abc import Callable

import structlog
from redis.exceptions import RedisError

from common import mesh_state, redis_conn
from common.outage import Outage
from router.money.batches import APPEND, Batch, parse_batch_id
from router.money.usage import (  # re-exported: the names callers know from here
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
COMMITS = ("before-reply", "after-reply")
COMMIT_DELAY_S = 0.0005


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
        commit: str = "before-reply",
        max_unwritten: int = 1000,
    ) -> None:
        self.redis = redis_conn.connect_async(
            redis_url, password=password, timeout_s=1.0, connect_timeout_s=0.5
        )
        # tenant, tokens, micro-USD of each billed call (and negative for a refund): the
        # tenant's tokens-per-minute and spend cap (router/tenancy/auth.py)
        self.charge: Callable[[str, int, int], None] | None = None
        self.router_id = router_id
        self.wait_s = wait_s
        if when_slow not in WHEN_SLOW:
            raise ValueError(f"when_slow must be one of {WHEN_SLOW}, not {when_slow!r}")
        self.when_slow = when_slow
        if commit not in COMMITS:
            raise ValueError(f"commit must be one of {COMMITS}, not {commit!r}")
        self.commit = commit
        self.max_unwritten = max_unwritten  # after-reply: records a kill -9 may lose, at most
        self._unwritten = 0  # records not in Redis yet (the current batch and the unsent)
        self._last_batch_records = 0
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
        self._dirty = False  # recorded since the flusher last looked
        self._waker: asyncio.Future | None = None
        self.redis_state = Outage("usage_flush_failed_keeping_in_memory", "usage_flush_recovered")
        self._last_appended = ""  # Redis must hold it (or its ack) at the next append
        self._records = 0  # calls recorded so far
        self._totals_written = -1  # self._records as of the last totals write
        self._append = self.redis.register_script(APPEND)
        self._tasks: list[asyncio.Task] = []

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
        shed: bool = False,
    ) -> asyncio.Future:
        """Count one call (of `tenant`, "" with auth off; `shed`: an error the router refused
        before it started); the returned future resolves once its batch is in Redis."""
        self.totals[(model, version)].add(ok, price_micro_usd, upstream_ns, tokens, finish, shed)
        batch = self._current
        key = mesh_state.model_key(model, version, tenant)
        batch.usage[key].add(ok, price_micro_usd, upstream_ns, tokens, finish, shed)
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
        batch.records += 1
        self._unwritten += 1
        if batch.durable is None:
            batch.durable = asyncio.get_running_loop().create_future()
        self._wake()
        return batch.durable

    def _wake(self) -> None:
        self._dirty = True
        if self._waker is not None and not self._waker.done():
            self._waker.set_result(None)

    def refund(self, receipt: Receipt) -> None:
        """Turn one recorded success into an error (its client never got the reply)."""
        self.totals[(receipt.model, receipt.version)].refund(receipt)
        self._records += 1
        key = mesh_state.model_key(receipt.model, receipt.version, receipt.tenant)
        self._current.usage[key].refund(receipt)
        self._current.records += 1
        self._unwritten += 1
        self._charge(receipt.tenant, receipt.tokens, receipt.price_micro_usd * receipt.call, -1)
        self._wake()

    async def durable(self, future: asyncio.Future) -> bool:
        """Wait (at most `wait_s`) for a record to reach Redis; True once it has. With
        commit `after-reply`, True at once while at most `max_unwritten` records are not
        in Redis yet (beyond that, a reply waits as with `before-reply`)."""
        if future.done():
            return future.result() is True
        if self.commit == "after-reply" and self._unwritten <= self.max_unwritten:
            return True
        if not self.redis_state.up:
            return False
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        timer = loop.call_later(self.wait_s, wake)
        future.add_done_callback(wake)
        try:
            await waiter  # cancelled alone: `future` is shared by the batch's calls
        finally:
            timer.cancel()
            future.remove_done_callback(wake)
        return future.done() and future.result() is True

    # -- the flusher -----------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop()), loop.create_task(self._totals_loop())]

    async def _loop(self) -> None:
        """Group commit: whatever was recorded while the last append was under way goes in
        the next one, at once. Under load (the last batch held more than one record and
        calls are in flight) it waits COMMIT_DELAY_S first, so calls about to finish join
        the batch instead of paying one Redis round trip each (a commit delay, as databases
        do); a lone call or a lone stream's pieces never wait for it."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._dirty:
                self._waker = loop.create_future()
                await self._waker
            self._dirty = False
            if self._last_batch_records > 1 and self.inflight() > 0:
                await asyncio.sleep(COMMIT_DELAY_S)
            await self.flush()

    async def _totals_loop(self) -> None:
        """The live totals (a few times a second, when they changed) and the forgetting of
        acked batches, beside the commits rather than between them."""
        next_maintenance = 0.0
        while True:
            await asyncio.sleep(TOTALS_EVERY_S)
            if time.monotonic() >= next_maintenance:
                await self._maintain()
                next_maintenance = time.monotonic() + self.maintenance_s
            if self._records != self._totals_written:
                with contextlib.suppress(RedisError, OSError):
                    await self._write_totals()

    async def flush(self) -> bool:
        """Close the current batch and write everything unsent; True when Redis has it all."""
        if self._current.usage:
            batch, self._current = self._current, self._new_batch()
            batch.at_ms = mesh_state.now_ms()
            self._last_batch_records = batch.records
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
        for b in sending:
            if not b.written:
                b.written = True
                self._unwritten -= b.records
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
        args = [self._last_appended, self.router_id]
        for b in batches:
            b.epoch = b.epoch or self.epoch
            args += b.args()
        keys = [
            mesh_state.calls_stream(self.router_id),
            mesh_state.ledger_ack_key(self.router_id),
            mesh_state.ROUTERS,
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
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.flush()
        with contextlib.suppress(RedisError, OSError):
            await self._write_totals()
        await self.redis.aclose()
