"""The ledger process: routers' batch streams in Redis -> the durable store, exactly once.

Each pass, for every router: read the stream past the store's cursor, apply those batches
(counts + cursor in one transaction), then tell the router (ack key) and trim the stream.
Crash anywhere and the next pass repeats the unacknowledged part; the cursor makes that a
no-op. The pass also records each live worker's uptime span (for serving cost) and each
model's price and training cost as the workers publish them.

Nothing read from Redis is trusted as it stands. A stream entry is counted only if it has
exactly the router's fields, a usage object keyed "model|version" for a model the ledger
knows (from a registration, its store or its config), and integer counts (the five call
counts of a router that predates token pricing, the eleven of one before cached tokens, or
all of USAGE_FIELDS) whose call counts
add up (success + errors = calls; calls, errors and upstream time >= 0; revenue of the sign
of success: a negative success is a refund). The token counts may be negative in a batch (a
streamed piece recorded, then refunded when it could not be delivered). Anything else is
quarantined in the store with the reason, and the cursor moves past it: one bad entry never
stops the ledger. A registration that does not parse is skipped with a log line; a model
whose live registrations disagree on its price or training cost keeps the terms recorded
before (one forged registration does not reprice a model). A batch key
"model|version|tenant" counts for a tenant the mesh knows (meshserve:tenants), else the
entry is quarantined. A well-formed forgery is kept out by Redis's ACL users
(devmesh/redis_acl.py): only the router role may append to the streams.
"""

from __future__ import annotations

import json

import structlog

from common import mesh_state, redis_conn
from common.mesh_state import WorkerInfo
from common.tenancy import TENANT_NAME
from common.tenant_directory import TenantDirectory
from ledger.config import LedgerConfig
from ledger.refill import Refiller
from ledger.restarts import RestartLog
from ledger.store import BatchEntry, Quarantined, Store, WorkerSpan

log = structlog.get_logger()

READ_COUNT = 10_000


def worker_kind(provider: str) -> str:
    return "gpu" if "CUDA" in provider or "Tensorrt" in provider else "cpu"


MAX_COUNT = 2**53  # any count beyond this is not a batch of one router's flush interval
# the counts a batch may carry: a router before token pricing, before cached tokens, now
LENGTHS = (
    len(mesh_state.CALL_FIELDS),
    len(mesh_state.CALL_FIELDS) + len(mesh_state.TOKEN_FIELDS),
    len(mesh_state.USAGE_FIELDS) - len(mesh_state.SHED_FIELDS),
    len(mesh_state.USAGE_FIELDS),
)


def parse_entry(
    entry_id: str,
    fields: dict[str, str],
    known: set[str] | None = None,
    tenants: set[str] | frozenset[str] = frozenset(),
) -> BatchEntry:
    """A stream entry -> its batch; ValueError says why it cannot be counted. A key
    "model|version|tenant" must name a tenant in `tenants`."""
    epoch, _, seq = entry_id.partition("-")
    if set(fields) != {"usage", "at_ms"}:
        raise ValueError(f"fields {sorted(fields)[:8]}, expected ['at_ms', 'usage']")
    at_ms = int(fields["at_ms"])
    if at_ms < 0:
        raise ValueError("at_ms < 0")
    usage_json = json.loads(fields["usage"])
    if not isinstance(usage_json, dict) or not usage_json:
        raise ValueError("usage must be a non-empty object")
    usage = {}
    for key, counts in usage_json.items():
        parts = key.split("|")
        if len(parts) not in (2, 3) or not all(0 < len(p) <= mesh_state.MAX_NAME for p in parts):
            raise ValueError(f"usage key {key[:64]!r} is not 'model|version[|tenant]'")
        if known is not None and parts[0] not in known:
            raise ValueError(f"model {parts[0][:64]!r} is not one the mesh serves")
        if len(parts) == 3 and parts[2] not in tenants:
            raise ValueError(f"tenant {parts[2][:64]!r} is not one the mesh knows")
        if (
            not isinstance(counts, list)
            or len(counts) not in LENGTHS
            or not all(type(c) is int and abs(c) < MAX_COUNT for c in counts)
        ):
            raise ValueError(f"{key[:64]!r}: counts must be {' or '.join(map(str, LENGTHS))} ints")
        counts = counts + [0] * (LENGTHS[-1] - len(counts))
        calls, success, errors, revenue, upstream_ns = counts[: LENGTHS[0]]
        if calls < 0 or errors < 0 or upstream_ns < 0 or success + errors != calls:
            raise ValueError(f"{key[:64]!r}: counts do not add up: {counts}")
        if not 0 <= counts[-1] <= errors:  # shed calls are errors (mesh_state.SHED_FIELDS)
            raise ValueError(f"{key[:64]!r}: {counts[-1]} shed of {errors} errors")
        if revenue * success < 0 or (success == 0 and revenue != 0):
            raise ValueError(f"{key[:64]!r}: revenue {revenue} for {success} successes")
        usage[tuple(parts)] = counts
    return BatchEntry(int(seq or 1), usage, at_ms, int(epoch))


def check_entry(
    entry_id: str,
    fields: dict[str, str],
    known: set[str] | None = None,
    tenants: set[str] | frozenset[str] = frozenset(),
) -> BatchEntry | Quarantined:
    try:
        return parse_entry(entry_id, fields, known, tenants)
    except (ValueError, TypeError, AttributeError) as e:
        epoch, _, seq = entry_id.partition("-")
        raw = json.dumps(fields)[:4096]
        log.error("ledger_entry_quarantined", entry=entry_id, reason=str(e)[:300])
        return Quarantined(int(epoch), int(seq or 1), str(e)[:300], raw)


class Consumer:
    def __init__(
        self,
        redis_url: str,
        store: Store,
        config: LedgerConfig,
        password: str | None = None,
        reconcile_s: float = 60.0,
        interval_s: float = 1.0,
    ) -> None:
        self.redis = redis_conn.connect(redis_url, password=password, timeout_s=5)
        self.directory = TenantDirectory(store)
        # tenants and keys: the database's, refilled into a Redis that lost them
        self.refiller = Refiller(self.redis, self.directory, store, reconcile_s)
        self.restarts = RestartLog(store, interval_s)  # Redis restarts: the report's notices
        self.store = store
        self.config = config
        # router -> (epoch, seq) committed (read once, then ours)
        self._cursors: dict[str, tuple[int, int]] = {}
        self._terms: dict[str, tuple[int, ...]] = {}  # model -> (p, T, prices) last recorded
        self._disputed: set[str] = set()  # models whose live replicas disagree on terms
        self._known: set[str] = set(config.models) | set(store.models())  # served models
        self._refused: set[str] = set()  # registration texts already logged as refused
        # tenants batches may count
        self._tenants: set[str] = set(store.tenants()) | set(self.directory.tenants())

    def flush(self) -> int:
        """One pass; returns the number of batches applied."""
        applied = 0
        self._watch_server()
        self.refiller.check()  # first: a Redis that lost the tenants serves no key meanwhile
        self._record_registry()  # first: the models it names are the ones batches may count
        tenants: set[str] = self.redis.smembers(mesh_state.TENANTS)  # type: ignore[assignment]
        self._tenants.update(t for t in tenants if TENANT_NAME.match(t))
        routers: set[str] = self.redis.smembers(mesh_state.ROUTERS)  # type: ignore[assignment]
        for router_id in sorted(routers):
            applied += self._drain(router_id)
        return applied

    def _watch_server(self) -> None:
        server: dict = self.redis.info("server")  # type: ignore[assignment]
        persistence: dict = self.redis.info("persistence")  # type: ignore[assignment]
        aof = bool(int(persistence.get("aof_enabled", 0)))
        if self.restarts.seen(str(server["run_id"]), aof, mesh_state.now_ms()):
            log.warning("redis_restart_noticed", run_id=server["run_id"], aof=aof)

    def _drain(self, router_id: str) -> int:
        stream = mesh_state.calls_stream(router_id)
        if router_id not in self._cursors:
            self._cursors[router_id] = self.store.cursor(router_id)
        cursor = self._cursors[router_id]
        applied = 0
        while True:
            start = f"({cursor[0]}-{cursor[1]}" if cursor != (0, 0) else "-"
            raw = self.redis.xrange(stream, min=start, count=READ_COUNT)
            good: list[BatchEntry] = []
            bad: list[Quarantined] = []
            for entry_id, fields in raw:  # type: ignore[union-attr]
                entry = check_entry(entry_id, fields, self._known, self._tenants)
                (bad if isinstance(entry, Quarantined) else good).append(entry)  # type: ignore[arg-type]
            if raw:
                cursor = self._cursors[router_id] = self.store.apply(
                    router_id, good, mesh_state.now_ms(), bad
                )
                applied += len(good)
            # Ack even with nothing new: a Redis that restarted lost the previous ack.
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(mesh_state.ledger_ack_key(router_id), f"{cursor[0]}-{cursor[1]}")
            if cursor != (0, 0):
                pipe.xtrim(stream, minid=f"{cursor[0]}-{cursor[1] + 1}", approximate=False)
            pipe.execute()
            if len(raw) < READ_COUNT:  # type: ignore[arg-type]
                return applied

    def _record_registry(self) -> None:
        now = mesh_state.now_ms()
        ids: list[str] = self.redis.zrangebyscore(mesh_state.WORKERS, now - 60_000, "+inf")  # type: ignore[assignment]
        if not ids:
            return
        infos = self.redis.mget([mesh_state.worker_key(i) for i in ids])
        spans = []
        terms_seen: dict[str, set[tuple[int, ...]]] = {}
        for raw in infos:  # type: ignore[union-attr]
            if raw is None:
                continue
            try:
                info = WorkerInfo.from_json(raw)
            except ValueError as e:
                if raw not in self._refused and len(self._refused) < 10_000:
                    self._refused.add(raw)
                    log.warning("ledger_registration_refused", reason=str(e)[:300])
                continue
            self._known.update(info.models)
            spans.append(WorkerSpan(info.id, info.started_ms, worker_kind(info.provider), now))
            for name, entry in info.models.items():
                terms_seen.setdefault(name, set()).add(
                    (
                        entry.price_micro_usd,
                        entry.training_cost_micro_usd,
                        entry.price_per_1k_input_tokens_micro_usd,
                        entry.price_per_1k_output_tokens_micro_usd,
                    )
                )
        for name, seen in terms_seen.items():
            if len(seen) > 1:  # replicas disagree: one of them is wrong (or forged)
                if name not in self._disputed:
                    self._disputed.add(name)
                    log.warning("ledger_model_terms_disputed", model=name[:64], terms=sorted(seen))
                continue
            self._disputed.discard(name)
            terms = next(iter(seen))
            if name not in self.config.models and self._terms.get(name) != terms:
                self.store.record_model(name, *terms)  # only when they change
                self._terms[name] = terms
        self.store.record_workers(spans)

    def close(self) -> None:
        self.redis.close()
