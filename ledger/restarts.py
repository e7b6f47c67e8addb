"""Redis restarts and failovers, as the ledger sees them, and what each may have lost.

Each pass reads the Redis server's run id (INFO server; a new one after every restart, and
another server's after a failover) and whether it keeps an append-only file (INFO
persistence). The first run id is recorded quietly; each new one after it is a notice with
its bound (docs/state.md):

- a crash of Redis alone loses no billed call: a router keeps every batch until the ledger
  has committed it, and sends again what Redis lost;
- a crash of the host that takes the routers with it loses what the AOF had not fsync'd:
  up to LOSS_WINDOW_S (appendfsync everysec) of calls, or, without an AOF, every batch the
  ledger had not read yet (its pass interval and more). The bound in calls is that window
  times the mesh's rate in the minute before (the ledger's own time buckets).
"""

from __future__ import annotations

import datetime as dt
import math

from common.sqldb import Database

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS redis_servers (
        run_id TEXT PRIMARY KEY, first_seen_ms BIGINT NOT NULL, aof BIGINT NOT NULL,
        bound_calls BIGINT NOT NULL, first BIGINT NOT NULL)""",
]
LOSS_WINDOW_S = 2.0  # everysec: Redis fsyncs each second, and waits up to 2 s on a slow disk
RATE_WINDOW_MS = 60_000
BUCKET_MS = 10_000  # ledger/store.py's usage_buckets resolution


class RestartLog:
    def __init__(self, db: Database, interval_s: float) -> None:
        self.db = db
        self.interval_s = interval_s  # the ledger's pass: what a Redis without AOF loses more
        db.create(SCHEMA)
        self._known: set[str] = set()

    def seen(self, run_id: str, aof: bool, now_ms: int) -> bool:
        """Record the server's run id; True when it is a restart or failover (a new one)."""
        if run_id in self._known:
            return False
        with self.db.transaction() as cur:
            if cur.execute("SELECT 1 FROM redis_servers WHERE run_id = ?", (run_id,)).one():
                self._known.add(run_id)
                return False
            first = cur.execute("SELECT COUNT(*) FROM redis_servers").one()[0] == 0
            since = (now_ms - RATE_WINDOW_MS) // BUCKET_MS
            row = cur.execute(
                "SELECT COALESCE(SUM(calls), 0), MIN(bucket) FROM usage_buckets WHERE bucket >= ?",
                (since,),
            ).one()
            calls = int(row[0])
            oldest_ms = int(row[1]) * BUCKET_MS if row[1] is not None else now_ms
            span_s = max(1.0, (now_ms - oldest_ms) / 1000)  # the seconds those calls took
            window = LOSS_WINDOW_S if aof else LOSS_WINDOW_S + self.interval_s
            bound = math.ceil(calls / span_s * window)
            cur.execute(
                "INSERT INTO redis_servers VALUES (?, ?, ?, ?, ?)",
                (run_id, now_ms, int(aof), bound, int(first)),
            )
        self._known.add(run_id)
        return not first

    def notices(self) -> list[str]:
        """One line per restart or failover the ledger noticed, oldest first."""
        with self.db.transaction() as cur:
            rows = cur.execute(
                "SELECT first_seen_ms, aof, bound_calls FROM redis_servers WHERE first = 0 "
                "ORDER BY first_seen_ms"
            ).all()
        lines = []
        for at_ms, aof, bound in rows:
            when = dt.datetime.fromtimestamp(int(at_ms) / 1000, dt.UTC)
            at = when.strftime("%Y-%m-%d %H:%M:%S UTC")
            kept = "with an AOF" if aof else "no AOF"
            lines.append(
                f"Redis restarted or failed over (noticed {at}, {kept}): up to {bound} calls may "
                "be missing if the routers went down with it; none if they stayed up"
            )
        return lines
