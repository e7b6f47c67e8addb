"""The mesh's SQL database: SQLite (one file, the default) or PostgreSQL (by URL), one dialect.

Its tables are the ledger's (ledger/store.py: billed calls) and the tenants' directory
(common/tenant_directory.py: tenants and API keys, their source of truth); the ledger
process and the admin CLI (`python -m router keys|tenants`) open the same database.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Database:
    """One connection; `transaction()` yields a Cursor and commits, or rolls back on error.
    SQLite runs in WAL mode with synchronous=FULL (a committed transaction is on disk)."""

    def __init__(self, url: str, schema: Sequence[str] = ()) -> None:
        self.url = url
        self.schema = tuple(schema)
        if url.startswith(("postgresql://", "postgres://")):
            import psycopg

            self.postgres = True
            self.conn: Any = psycopg.connect(url, autocommit=False)
        else:
            path = url.removeprefix("sqlite:///") if url.startswith("sqlite:") else url
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.postgres = False
            self.conn = sqlite3.connect(path, isolation_level=None, timeout=30)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
        self.create(self.schema)

    def create(self, schema: Sequence[str]) -> None:
        """Run CREATE ... IF NOT EXISTS statements (idempotent) in one transaction."""
        with self.transaction() as cur:
            for statement in schema:
                cur.execute(statement)

    @contextmanager
    def transaction(self) -> Iterator[Cursor]:
        cur = self.conn.cursor()
        if not self.postgres:
            cur.execute("BEGIN IMMEDIATE")
        try:
            yield Cursor(cur, self.postgres)
        except BaseException:
            self.conn.rollback()
            raise
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()

    def reconnect(self) -> None:
        """After a database error: a fresh connection (a broken one stays broken)."""
        with contextlib.suppress(Exception):
            self.conn.close()
        Database.__init__(self, self.url, self.schema)


class Cursor:
    """One SQL dialect for both backends: write `?` placeholders, PostgreSQL gets `%s`."""

    def __init__(self, cur: Any, postgres: bool) -> None:
        self.cur = cur
        self.postgres = postgres

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        self.cur.execute(sql.replace("?", "%s") if self.postgres else sql, params)
        return self

    def one(self) -> Any:
        return self.cur.fetchone()

    def all(self) -> list[Any]:
        return list(self.cur.fetchall())
