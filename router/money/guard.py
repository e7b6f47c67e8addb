"""RequestGuard: the bookkeeping of one request, from its admission to its end.

One guard per request, whether it came as a ModelInfer or as one request of a
ModelStreamInfer (a unary call is a stream of one response). It owns what the request
holds and what it counts, so no forwarding code keeps a second copy:

- its admission slot (the router's in-flight limits, see `Admission`), released once;
- what it is billed: the token meter of a model priced per token, each response's tokens
  (`bill`), the call itself when it ends (`end`: success, or error with its code), and the
  receipts that `refund` takes back when a billed response did not reach its client;
- its metrics: requests by code (counted once, by `count`), time upstream and in the router,
  time to first token and between tokens, tokens in and out.

The dispatcher (router/forwarding/dispatch.py) makes guards (`Dispatcher.open`), binds each to the
replica it picked and adds the time upstream; the front ends (the unary servicer,
router/forwarding/streams.py, an HTTP layer) call `bill`/`end`, wait for the records with
`Accounting.durable`, and `refund` what they could not deliver.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from common.errors import ResourceExhausted, clip
from common.mesh_state import ModelEntry
from router.money import billing
from router.money.accounting import NO_TOKENS, Accounting, Receipt, Tokens
from router.money.billing import Piece
from router.telemetry import metrics
from router.tenancy.auth import Tenant

OK = grpc.StatusCode.OK
UNKNOWN = "_unknown_"  # the one label and ledger version for what the mesh does not serve


class Admission:
    """The router's in-flight limits: at most `max_inflight` requests at once, and
    `max_inflight_per_model` per model; beyond them RESOURCE_EXHAUSTED at once (no queue)."""

    def __init__(self, max_inflight: int, max_inflight_per_model: int) -> None:
        self.max_inflight = max_inflight
        self.max_inflight_per_model = max_inflight_per_model
        self.inflight = 0
        self.by_model: Counter[str] = Counter()

    def admit(self, model: str) -> None:
        if self.inflight >= self.max_inflight:
            metrics.REJECTED.labels("total").inc()
            raise ResourceExhausted(
                f"the router has {self.inflight} calls in flight, its limit; retry later"
            )
        if self.by_model[model] >= self.max_inflight_per_model:
            metrics.REJECTED.labels("model").inc()
            raise ResourceExhausted(
                f"the router has {self.by_model[model]} calls to model "
                f"{clip(model)} in flight, its per-model limit; retry later"
            )
        self.inflight += 1
        self.by_model[model] += 1

    def release(self, model: str) -> None:
        self.inflight -= 1
        self.by_model[model] -= 1
        if not self.by_model[model]:
            del self.by_model[model]


@dataclass(eq=False)
class RequestGuard:
    """One request's bookkeeping (see the module docstring)."""

    accounting: Accounting | None
    admission: Admission
    id: str
    model: str
    asked_version: str  # as the client asked ("" = the latest)
    tenant: Tenant | None = None
    session: str | None = (
        None  # session_id / conversation_id: affinity (router/forwarding/affinity.py)
    )
    streamed: bool = False  # one request of a ModelStreamInfer (TTFT and inter-token metrics)
    entry: ModelEntry | None = None  # None: no replica serves the model (nothing to bill)
    version: str = ""  # the version it is billed under once `entry` is known
    meter: billing.TokenMeter | None = None
    upstream_s: float = 0.0
    ended: bool = False  # its call is recorded
    refused: bool = False  # by its tenant's key, models or limits: not a call of the model
    shed: bool = False  # refused by the router's queue-wait prediction: a call, counted shed
    admitted: bool = False
    counted: bool = False  # in metrics.REQUESTS
    started: float = field(default_factory=time.perf_counter)
    last_piece: float | None = None  # when the last piece carrying tokens came
    tokens_out: int = 0  # completion tokens seen so far

    @property
    def label(self) -> str:
        return self.model if self.entry is not None else UNKNOWN

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant is not None else ""

    @property
    def priority(self) -> str:
        return self.tenant.policy.priority if self.tenant is not None else "normal"

    def serve(self, entry: ModelEntry, version: str) -> None:
        """The model's registration and the version the request is billed under."""
        if self.entry is None and billing.priced_per_token(entry):
            self.meter = billing.TokenMeter.of(entry)
        self.entry, self.version = entry, version

    def admit(self) -> None:
        self.admission.admit(self.model)
        self.admitted = True

    def release(self) -> None:
        """Give back the admission slot (once; a no-op after)."""
        if self.admitted:
            self.admitted = False
            self.admission.release(self.model)

    # -- billing ---------------------------------------------------------------------------

    def bill(
        self, piece: Piece | None, ends: bool, code: grpc.StatusCode = OK
    ) -> tuple[Receipt | None, asyncio.Future | None]:
        """Record what one response bills (its tokens beyond those billed already; with
        `ends`, the call itself, an error unless `code` is OK). The receipt is what `refund`
        takes back if the response does not reach the client; the future resolves once the
        record is in Redis (None: nothing recorded)."""
        tokens = NO_TOKENS
        if piece is not None:
            self._observe(piece)
            if self.meter is not None:
                tokens = self.meter.advance(piece)
        if ends:
            finish = piece.finish_reason if piece is not None else None
            return self.end(code, finish, tokens)
        if tokens == NO_TOKENS or self.accounting is None or self.entry is None:
            return None, None
        tenant = self.tenant_name
        future = self.accounting.record_tokens(self.model, self.version, tokens, tenant)
        return Receipt(self.model, self.version, 0, tokens, call=False, tenant=tenant), future

    def end(
        self, code: grpc.StatusCode, finish: str | None = None, tokens: Tokens = NO_TOKENS
    ) -> tuple[Receipt | None, asyncio.Future | None]:
        """Record the call (once): a success with `code` OK, else an error."""
        self.ended = True
        metrics.LATENCY.labels("upstream").observe(self.upstream_s)
        if not self.streamed:
            router_s = time.perf_counter() - self.started - self.upstream_s
            metrics.LATENCY.labels("router").observe(router_s)
        if self.accounting is None or self.entry is None or self.refused:
            return None, None
        ok = code == OK
        price = self.entry.price_micro_usd
        if self.meter is None:
            finish = None
        elif ok:
            finish = finish or ""
        tenant = self.tenant_name
        future = self.accounting.record(
            self.model,
            self.version,
            ok,
            price,
            int(self.upstream_s * 1e9),
            tokens,
            finish,
            tenant,
            self.shed,
        )
        if ok:
            return Receipt(self.model, self.version, price, tokens, finish, tenant=tenant), future
        if tokens != NO_TOKENS:
            return Receipt(self.model, self.version, 0, tokens, call=False, tenant=tenant), future
        return None, future

    def refund(self, receipt: Receipt | None) -> None:
        """A billed response that did not reach the client: taken back."""
        if receipt is None or self.accounting is None:
            return
        if self.meter is not None:
            self.meter.take_back(receipt.tokens)
        self.accounting.refund(receipt)
        metrics.REFUNDS.inc()

    def count(self, code: grpc.StatusCode) -> None:
        """The request's outcome in metrics.REQUESTS (once)."""
        if not self.counted:
            self.counted = True
            metrics.REQUESTS.labels(self.label, code.name).inc()

    def close(self, code: grpc.StatusCode) -> None:
        """The request is over: the slot goes back; a call not recorded yet is recorded
        as an error with `code` (cut before its end, its pieces billed), and counted."""
        self.release()
        if not self.ended:
            self.end(code)
        self.count(code)

    def _observe(self, piece: Piece) -> None:
        """Tokens in and out; for a stream, the time to its first token and between tokens
        (from the running counts each piece carries)."""
        if piece.completion_tokens is None or piece.completion_tokens <= self.tokens_out:
            return
        now = time.perf_counter()
        new = piece.completion_tokens - self.tokens_out
        if self.last_piece is None:
            if self.streamed:
                metrics.TTFT.labels(self.label).observe(now - self.started)
            if piece.prompt_tokens:
                metrics.TOKENS.labels(self.label, "in").inc(piece.prompt_tokens)
        elif self.streamed:
            metrics.INTER_TOKEN.labels(self.label).observe((now - self.last_piece) / new)
        metrics.TOKENS.labels(self.label, "out").inc(new)
        self.last_piece, self.tokens_out = now, piece.completion_tokens
