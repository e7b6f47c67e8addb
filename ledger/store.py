"""The durable ledger: SQLite (one file, the default) or PostgreSQL (by URL).

Exactly once: a router's batches carry ids (epoch, seq): the epoch is the router process's
start (unix ms), seq counts 1, 2, 3... within it, so a router restarted under the same id
goes on above its previous process. `apply` adds a batch's counts and advances that
router's cursor in ONE transaction, skipping every id at or below the cursor. A batch that
did not pass the consumer's checks is stored in `quarantine` with the reason and its raw
text, and the cursor moves past it: it is kept for a person to look at, never counted.

A batch seen twice (re-read after a crash between commit and ack, or re-sent by
a router after a Redis restart) therefore changes nothing, and a crash mid-transaction
leaves neither the counts nor the cursor moved.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from common.mesh_state import CACHE_FIELDS, CALL_FIELDS, SHED_FIELDS, TOKEN_FIELDS, USAGE_FIELDS
from common.sqldb import Cursor, Database

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS cursors (
        router_id TEXT PRIMARY KEY, seq BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS usage (
        model TEXT NOT NULL, version TEXT NOT NULL, calls BIGINT NOT NULL,
        success BIGINT NOT NULL, errors BIGINT NOT NULL, revenue_micro_usd BIGINT NOT NULL,
        upstream_ns BIGINT NOT NULL, PRIMARY KEY (model, version))""",
    """CREATE TABLE IF NOT EXISTS usage_buckets (
        model TEXT NOT NULL, bucket BIGINT NOT NULL, calls BIGINT NOT NULL,
        revenue_micro_usd BIGINT NOT NULL, PRIMARY KEY (model, bucket))""",
    """CREATE TABLE IF NOT EXISTS workers (
        worker_id TEXT NOT NULL, started_ms BIGINT NOT NULL, kind TEXT NOT NULL,
        last_seen_ms BIGINT NOT NULL, PRIMARY KEY (worker_id, started_ms))""",
    """CREATE TABLE IF NOT EXISTS models (
        model TEXT PRIMARY KEY, price_micro_usd BIGINT NOT NULL,
        training_cost_micro_usd BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS gaps (
        router_id TEXT NOT NULL, after_seq BIGINT NOT NULL, next_seq BIGINT NOT NULL,
        noticed_ms BIGINT NOT NULL)""",
    # `cursors` held a bare seq before ids had an epoch: its seq s was the stream id "s-1".
    """CREATE TABLE IF NOT EXISTS stream_cursors (
        router_id TEXT PRIMARY KEY, epoch BIGINT NOT NULL, seq BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS quarantine (
        router_id TEXT NOT NULL, entry_id TEXT NOT NULL, reason TEXT NOT NULL,
        raw TEXT NOT NULL, noticed_ms BIGINT NOT NULL)""",
    # LLM models: tokens in/out and their revenue per model version, and the per-1k-token
    # prices; tables of their own so a ledger database from before token pricing just
    # gains them (no ALTER TABLE).
    """CREATE TABLE IF NOT EXISTS token_usage (
        model TEXT NOT NULL, version TEXT NOT NULL, prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL, token_revenue_micro_usd BIGINT NOT NULL,
        finished_stop BIGINT NOT NULL, finished_length BIGINT NOT NULL,
        finished_other BIGINT NOT NULL, PRIMARY KEY (model, version))""",
    """CREATE TABLE IF NOT EXISTS token_prices (
        model TEXT PRIMARY KEY, per_1k_input_micro_usd BIGINT NOT NULL,
        per_1k_output_micro_usd BIGINT NOT NULL)""",
    # Per tenant (auth on): the same counts by tenant, model and version; `usage` and
    # `token_usage` keep the totals over every tenant.
    """CREATE TABLE IF NOT EXISTS tenant_usage (
        tenant TEXT NOT NULL, model TEXT NOT NULL, version TEXT NOT NULL,
        calls BIGINT NOT NULL, success BIGINT NOT NULL, errors BIGINT NOT NULL,
        revenue_micro_usd BIGINT NOT NULL, upstream_ns BIGINT NOT NULL,
        prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL,
        token_revenue_micro_usd BIGINT NOT NULL, PRIMARY KEY (tenant, model, version))""",
    # Prompt tokens served from the workers' prefix caches and the discount their price
    # gave, per model version and per tenant (tables of their own, as token_usage).
    """CREATE TABLE IF NOT EXISTS cache_usage (
        model TEXT NOT NULL, version TEXT NOT NULL, cached_tokens BIGINT NOT NULL,
        cached_discount_micro_usd BIGINT NOT NULL, PRIMARY KEY (model, version))""",
    """CREATE TABLE IF NOT EXISTS tenant_cache_usage (
        tenant TEXT NOT NULL, model TEXT NOT NULL, version TEXT NOT NULL,
        cached_tokens BIGINT NOT NULL, cached_discount_micro_usd BIGINT NOT NULL,
        PRIMARY KEY (tenant, model, version))""",
    # Calls the routers shed before they started (counted in `usage` as errors too), per
    # model version and tenant ("" with auth off).
    """CREATE TABLE IF NOT EXISTS shed_usage (
        model TEXT NOT NULL, version TEXT NOT NULL, tenant TEXT NOT NULL, shed BIGINT NOT NULL,
        PRIMARY KEY (model, version, tenant))""",
    # What each tenant was billed per UTC month (YYYYMM of the batch): the spend a Redis
    # that lost its counters is refilled with (ledger/refill.py).
    """CREATE TABLE IF NOT EXISTS tenant_spend (
        tenant TEXT NOT NULL, month TEXT NOT NULL, micro_usd BIGINT NOT NULL,
        PRIMARY KEY (tenant, month))""",
]
TENANT_FIELDS = (*CALL_FIELDS, "prompt_tokens", "completion_tokens", "token_revenue_micro_usd")

FIELDS = CALL_FIELDS  # the usage table's count columns; TOKEN_FIELDS are token_usage's
BUCKET_MS = 10_000  # time series resolution for rates and plots


def utc_month(at_ms: int) -> str:
    """YYYYMM (UTC) of a unix ms: the month of a tenant's spend (router/tenancy/limits.py's too)."""
    return dt.datetime.fromtimestamp(at_ms / 1000, dt.UTC).strftime("%Y%m")


@dataclass(frozen=True)
class BatchEntry:
    seq: int
    # (model, version) or (model, version, tenant) -> counts in USAGE_FIELDS order
    usage: dict[tuple[str, ...], list[int]]
    at_ms: int
    epoch: int = 0

    @property
    def id(self) -> tuple[int, int]:
        return (self.epoch, self.seq)


@dataclass(frozen=True)
class Quarantined:
    """A stream entry that did not pass the consumer's checks: kept, not counted."""

    epoch: int
    seq: int
    reason: str
    raw: str

    @property
    def id(self) -> tuple[int, int]:
        return (self.epoch, self.seq)


@dataclass(frozen=True)
class WorkerSpan:
    worker_id: str
    started_ms: int
    kind: str
    last_seen_ms: int


class Store(Database):
    """The ledger's tables on the mesh's database (common/sqldb.py)."""

    def __init__(self, url: str) -> None:
        super().__init__(url, SCHEMA)

    # -- writes ----------------------------------------------------------------------------

    def cursor(self, router_id: str) -> tuple[int, int]:
        with self.transaction() as cur:
            return self._cursor(cur, router_id, lock=False)

    def _cursor(self, cur: Cursor, router_id: str, lock: bool) -> tuple[int, int]:
        for_update = " FOR UPDATE" if lock and self.postgres else ""
        row = cur.execute(
            f"SELECT epoch, seq FROM stream_cursors WHERE router_id = ?{for_update}", (router_id,)
        ).one()
        if row:
            return int(row[0]), int(row[1])
        row = cur.execute("SELECT seq FROM cursors WHERE router_id = ?", (router_id,)).one()
        return (int(row[0]), 1) if row and int(row[0]) else (0, 0)

    def apply(
        self,
        router_id: str,
        entries: Sequence[BatchEntry],
        now_ms: int,
        quarantined: Sequence[Quarantined] = (),
    ) -> tuple[int, int]:
        """Apply the batches above this router's cursor in id order, quarantine the entries
        that did not pass the checks; return the new cursor (epoch, seq)."""
        with self.transaction() as cur:
            cursor = self._cursor(cur, router_id, lock=True)
            start = cursor
            pending: list[BatchEntry | Quarantined] = [*entries, *quarantined]
            for entry in sorted(pending, key=lambda e: e.id):
                if entry.id <= cursor:
                    continue  # applied before: exactly once
                expected = cursor[1] + 1 if entry.epoch == cursor[0] else 1
                if entry.seq != expected:
                    after = cursor[1] if entry.epoch == cursor[0] else 0
                    cur.execute(
                        "INSERT INTO gaps VALUES (?, ?, ?, ?)",
                        (router_id, after, entry.seq, now_ms),
                    )
                if isinstance(entry, Quarantined):
                    cur.execute(
                        "INSERT INTO quarantine VALUES (?, ?, ?, ?, ?)",
                        (router_id, f"{entry.epoch}-{entry.seq}", entry.reason, entry.raw, now_ms),
                    )
                else:
                    for (model, version, *tenant), counts in entry.usage.items():
                        self._add_usage(cur, model, version, counts, entry.at_ms)
                        _add_shed(cur, model, version, tenant[0] if tenant else "", counts)
                        if tenant:
                            self._add_tenant_usage(cur, tenant[0], model, version, counts)
                            self._add_spend(cur, tenant[0], counts, entry.at_ms)
                cursor = entry.id
            if cursor != start:
                cur.execute(
                    "INSERT INTO stream_cursors VALUES (?, ?, ?) ON CONFLICT (router_id) "
                    "DO UPDATE SET epoch = excluded.epoch, seq = excluded.seq",
                    (router_id, *cursor),
                )
        return cursor

    @staticmethod
    def _add_usage(cur: Cursor, model: str, version: str, counts: list[int], at_ms: int) -> None:
        calls = counts[: len(FIELDS)]
        tokens = counts[len(FIELDS) : len(FIELDS) + len(TOKEN_FIELDS)]
        at = len(FIELDS) + len(TOKEN_FIELDS)
        cached = counts[at : at + len(CACHE_FIELDS)]
        if any(cached):
            _add_counts(cur, "cache_usage", CACHE_FIELDS, (model, version), cached)
        _add_counts(cur, "usage", FIELDS, (model, version), calls)
        if any(tokens):
            _add_counts(cur, "token_usage", TOKEN_FIELDS, (model, version), tokens)
        revenue = calls[3] + (tokens[2] if tokens else 0)  # per call + per token
        cur.execute(
            "INSERT INTO usage_buckets VALUES (?, ?, ?, ?) ON CONFLICT (model, bucket) "
            "DO UPDATE SET calls = usage_buckets.calls + excluded.calls, "
            "revenue_micro_usd = usage_buckets.revenue_micro_usd + excluded.revenue_micro_usd",
            (model, at_ms // BUCKET_MS, calls[1], revenue),
        )

    @staticmethod
    def _add_tenant_usage(
        cur: Cursor, tenant: str, model: str, version: str, counts: list[int]
    ) -> None:
        by_name = dict(zip(USAGE_FIELDS, counts, strict=False))
        cached = [by_name.get(f, 0) for f in CACHE_FIELDS]
        if any(cached):
            sets = ", ".join(f"{f} = tenant_cache_usage.{f} + excluded.{f}" for f in CACHE_FIELDS)
            cur.execute(
                "INSERT INTO tenant_cache_usage VALUES (?, ?, ?, ?, ?) "
                f"ON CONFLICT (tenant, model, version) DO UPDATE SET {sets}",
                (tenant, model, version, *cached),
            )
        values = [by_name.get(f, 0) for f in TENANT_FIELDS]
        sets = ", ".join(f"{f} = tenant_usage.{f} + excluded.{f}" for f in TENANT_FIELDS)
        marks = ", ".join("?" for _ in range(3 + len(TENANT_FIELDS)))
        cur.execute(
            f"INSERT INTO tenant_usage VALUES ({marks}) "
            f"ON CONFLICT (tenant, model, version) DO UPDATE SET {sets}",
            (tenant, model, version, *values),
        )

    @staticmethod
    def _add_spend(cur: Cursor, tenant: str, counts: list[int], at_ms: int) -> None:
        by_name = dict(zip(USAGE_FIELDS, counts, strict=False))
        spend = by_name["revenue_micro_usd"] + by_name.get("token_revenue_micro_usd", 0)
        if spend:
            cur.execute(
                "INSERT INTO tenant_spend VALUES (?, ?, ?) ON CONFLICT (tenant, month) "
                "DO UPDATE SET micro_usd = tenant_spend.micro_usd + excluded.micro_usd",
                (tenant, utc_month(at_ms), spend),
            )

    def record_workers(self, spans: Sequence[WorkerSpan]) -> None:
        with self.transaction() as cur:
            for s in spans:
                cur.execute(
                    "INSERT INTO workers VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (worker_id, started_ms) DO UPDATE SET last_seen_ms = CASE "
                    "WHEN excluded.last_seen_ms > workers.last_seen_ms "
                    "THEN excluded.last_seen_ms ELSE workers.last_seen_ms END",
                    (s.worker_id, s.started_ms, s.kind, s.last_seen_ms),
                )

    def record_model(
        self,
        model: str,
        price_micro_usd: int,
        training_cost_micro_usd: int,
        per_1k_input_micro_usd: int = 0,
        per_1k_output_micro_usd: int = 0,
    ) -> None:
        with self.transaction() as cur:
            cur.execute(
                "INSERT INTO models VALUES (?, ?, ?) ON CONFLICT (model) DO UPDATE SET "
                "price_micro_usd = excluded.price_micro_usd, "
                "training_cost_micro_usd = excluded.training_cost_micro_usd",
                (model, price_micro_usd, training_cost_micro_usd),
            )
            cur.execute(
                "INSERT INTO token_prices VALUES (?, ?, ?) ON CONFLICT (model) DO UPDATE SET "
                "per_1k_input_micro_usd = excluded.per_1k_input_micro_usd, "
                "per_1k_output_micro_usd = excluded.per_1k_output_micro_usd",
                (model, per_1k_input_micro_usd, per_1k_output_micro_usd),
            )

    # -- reads -----------------------------------------------------------------------------

    def usage(self) -> dict[tuple[str, str], dict[str, int]]:
        """(model, version) -> every count of USAGE_FIELDS (tokens 0 for other models)."""
        with self.transaction() as cur:
            rows = cur.execute(f"SELECT model, version, {', '.join(FIELDS)} FROM usage").all()
            token_rows = cur.execute(
                f"SELECT model, version, {', '.join(TOKEN_FIELDS)} FROM token_usage"
            ).all()
            cache_rows = cur.execute(
                f"SELECT model, version, {', '.join(CACHE_FIELDS)} FROM cache_usage"
            ).all()
        usage = {
            (r[0], r[1]): dict.fromkeys(USAGE_FIELDS, 0)
            | dict(zip(FIELDS, map(int, r[2:]), strict=True))
            for r in rows
        }
        for fields, table in ((TOKEN_FIELDS, token_rows), (CACHE_FIELDS, cache_rows)):
            for r in table:
                counts = usage.setdefault((r[0], r[1]), dict.fromkeys(USAGE_FIELDS, 0))
                counts.update(zip(fields, map(int, r[2:]), strict=True))
        for (model, version, _), n in self.shed().items():
            usage.setdefault((model, version), dict.fromkeys(USAGE_FIELDS, 0))["shed"] += n
        return usage

    def tenant_usage(self) -> dict[tuple[str, str], dict[str, int]]:
        """(tenant, model) -> TENANT_FIELDS and CACHE_FIELDS summed over the model's
        versions."""
        sums = ", ".join(f"SUM({f})" for f in TENANT_FIELDS)
        with self.transaction() as cur:
            rows = cur.execute(
                f"SELECT tenant, model, {sums} FROM tenant_usage GROUP BY tenant, model"
            ).all()
            cache_sums = ", ".join(f"SUM({f})" for f in CACHE_FIELDS)
            cache_rows = cur.execute(
                f"SELECT tenant, model, {cache_sums} FROM tenant_cache_usage GROUP BY tenant, model"
            ).all()
        usage = {
            (r[0], r[1]): dict(zip(TENANT_FIELDS, map(int, r[2:]), strict=True))
            | dict.fromkeys(CACHE_FIELDS, 0)
            for r in rows
        }
        for r in cache_rows:
            if (r[0], r[1]) in usage:
                usage[(r[0], r[1])].update(zip(CACHE_FIELDS, map(int, r[2:]), strict=True))
        return usage

    def shed(self) -> dict[tuple[str, str, str], int]:
        """(model, version, tenant) -> calls shed before they started."""
        with self.transaction() as cur:
            rows = cur.execute("SELECT model, version, tenant, shed FROM shed_usage").all()
        return {(r[0], r[1], r[2]): int(r[3]) for r in rows}

    def tenant_spend(self, month: str) -> dict[str, int]:
        """tenant -> micro-USD billed in the UTC month YYYYMM."""
        with self.transaction() as cur:
            rows = cur.execute(
                "SELECT tenant, micro_usd FROM tenant_spend WHERE month = ?", (month,)
            ).all()
        return {r[0]: int(r[1]) for r in rows}

    def tenants(self) -> list[str]:
        with self.transaction() as cur:
            rows = cur.execute("SELECT DISTINCT tenant FROM tenant_usage").all()
        return sorted(r[0] for r in rows)

    def token_prices(self) -> dict[str, tuple[int, int]]:
        """model -> (micro-USD per 1k input tokens, per 1k output tokens)."""
        with self.transaction() as cur:
            rows = cur.execute("SELECT * FROM token_prices").all()
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    def buckets(self, model: str) -> list[tuple[int, int, int]]:
        """(bucket start ms, successful calls, revenue) in time order."""
        with self.transaction() as cur:
            rows = cur.execute(
                "SELECT bucket, calls, revenue_micro_usd FROM usage_buckets "
                "WHERE model = ? ORDER BY bucket",
                (model,),
            ).all()
        return [(int(a) * BUCKET_MS, int(b), int(c)) for a, b, c in rows]

    def workers(self) -> list[WorkerSpan]:
        with self.transaction() as cur:
            rows = cur.execute(
                "SELECT worker_id, started_ms, kind, last_seen_ms FROM workers"
            ).all()
        return [WorkerSpan(r[0], int(r[1]), r[2], int(r[3])) for r in rows]

    def models(self) -> dict[str, tuple[int, int]]:
        with self.transaction() as cur:
            rows = cur.execute(
                "SELECT model, price_micro_usd, training_cost_micro_usd FROM models"
            ).all()
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    def quarantine(self) -> list[tuple[str, str, str]]:
        """(router, entry id, reason) of every entry kept out of the counts."""
        with self.transaction() as cur:
            rows = cur.execute("SELECT router_id, entry_id, reason FROM quarantine").all()
        return [(r[0], r[1], r[2]) for r in rows]

    def gaps(self) -> list[tuple[str, int, int]]:
        with self.transaction() as cur:
            rows = cur.execute("SELECT router_id, after_seq, next_seq FROM gaps").all()
        return [(r[0], int(r[1]), int(r[2])) for r in rows]


def _add_counts(
    cur: Cursor, table: str, fields: Sequence[str], key: tuple[str, str], counts: list[int]
) -> None:
    """Add `counts` to the (model, version) row `key` of `table`, inserting it if new."""
    sets = ", ".join(f"{f} = {table}.{f} + excluded.{f}" for f in fields)
    marks = ", ".join("?" * (len(key) + len(counts)))
    cur.execute(
        f"INSERT INTO {table} VALUES ({marks}) ON CONFLICT (model, version) DO UPDATE SET {sets}",
        (*key, *counts),
    )


def _add_shed(cur: Cursor, model: str, version: str, tenant: str, counts: list[int]) -> None:
    shed = dict(zip(USAGE_FIELDS, counts, strict=False)).get(SHED_FIELDS[0], 0)
    if shed:
        cur.execute(
            "INSERT INTO shed_usage VALUES (?, ?, ?, ?) ON CONFLICT (model, version, tenant) "
            "DO UPDATE SET shed = shed_usage.shed + excluded.shed",
            (model, version, tenant, shed),
        )
