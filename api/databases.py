"""The two databases the job store runs on: an SQLite file (one machine) or a PostgreSQL server (replicas).

`JobStore` (api/jobs.py) writes its SQL once, against the small `Database` interface below; each class
here supplies what differs between the two engines:

| | `SqliteDatabase` | `PostgresDatabase` |
|---|---|---|
| connections | one, serialised by a lock (NOTE [one connection]) | a `psycopg_pool.ConnectionPool` |
| atomic claim | `BEGIN IMMEDIATE` (one writer at a time) | `SELECT ... FOR UPDATE SKIP LOCKED` |
| clock | SQLite's `julianday('now')` | the server's `clock_timestamp()`, one clock for every replica |
| migrations | `PRAGMA user_version`, `BEGIN IMMEDIATE` | table `planner_schema`, `pg_advisory_xact_lock` |
| `shared` | False: one process owns the file | True: other replicas use the same rows |

Statements are written with `?` placeholders; `PostgresDatabase` turns them into psycopg's `%s` (the
store's SQL contains no other `?` or `%`).

NOTE [one connection]: one SQLite connection is shared by the event loop and the worker threads,
serialised by a lock. Statements are short (a row by primary key), so the lock is never held for long,
and WAL journaling with synchronous=NORMAL keeps every committed transaction across a process crash.

Migrations are numbered lists of statements (`MIGRATIONS`); a database records the last one applied, and
each start applies the rest inside one transaction that holds a lock, so two replicas starting at the
same moment apply each migration once (PostgreSQL's `CREATE TABLE IF NOT EXISTS` alone is not safe
against a concurrent twin: both can pass the check and one fails on the catalog's unique index).
"""

from __future__ import annotations

import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Database", "PostgresDatabase", "Rows", "Run", "SqliteDatabase", "open_database", "redact_url"]

Rows = list[tuple[Any, ...]]
Run = Callable[[str, tuple[Any, ...]], Rows]
"""Runs one statement inside the current transaction and returns its rows (empty without RETURNING)."""

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
MIGRATION_LOCK_ID = 0x706C616E6E6572
"""The advisory lock key held while migrating ("planner" in ASCII), so that replicas migrate one at a time."""
CONNECT_TIMEOUT_S = 10.0


def _migrations(*, real: str, big_integer: str) -> list[list[str]]:
    """Schema versions 1, 2, ... as lists of statements, with each engine's column types."""
    return [
        [
            f"""CREATE TABLE IF NOT EXISTS jobs (
                id TEXT PRIMARY KEY,
                request_key TEXT NOT NULL,
                status TEXT NOT NULL,
                request TEXT NOT NULL,
                budget_bytes {big_integer} NOT NULL,
                solver TEXT NOT NULL,
                result TEXT,
                error TEXT,
                reusable INTEGER NOT NULL DEFAULT 1,
                attempts INTEGER NOT NULL DEFAULT 0,
                created_at {real} NOT NULL,
                updated_at {real} NOT NULL
            )""",
            "CREATE INDEX IF NOT EXISTS jobs_by_key ON jobs (request_key, created_at)",
            "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, created_at)",
        ],
        # version 2: leases, so that a job whose runner died can be taken by another
        [
            "ALTER TABLE jobs ADD COLUMN owner TEXT",
            f"ALTER TABLE jobs ADD COLUMN lease_expires_at {real}",
        ],
    ]


class Database(ABC):
    """What `JobStore` needs from an engine: transactions, a clock expression, and a health check.

    Subclasses: `SqliteDatabase`, `PostgresDatabase`.
    """

    now_sql: str
    """An SQL expression for the current time in seconds since the epoch, on the database's clock."""
    skip_locked_sql: str
    """Appended to the SELECT that picks a job to claim, so that concurrent claimers pass each other."""
    shared: bool
    """True when other processes may use the same rows (a running job may belong to a live replica)."""
    location: str
    """Where the data lives, for messages (a file path, or a URL without its password)."""

    @abstractmethod
    @contextmanager
    def transaction(self) -> Iterator[Run]:
        """One transaction: committed when the block ends, rolled back when it raises."""

    def run(self, sql: str, parameters: tuple[Any, ...] = ()) -> Rows:
        """One statement in a transaction of its own."""
        with self.transaction() as run:
            return run(sql, parameters)

    @abstractmethod
    def ping(self) -> bool:
        """True when the database answers a query."""

    @abstractmethod
    def close(self) -> None: ...


class SqliteDatabase(Database):
    """An SQLite file with WAL journaling; one connection behind a lock (see NOTE [one connection])."""

    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    skip_locked_sql = ""
    shared = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = str(path)
        self._lock = threading.Lock()
        self._connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    def _migrate(self) -> None:
        migrations = _migrations(real="REAL", big_integer="INTEGER")
        with self.transaction() as run:
            version = int(run("PRAGMA user_version", ())[0][0])
            fresh = not run("SELECT name FROM sqlite_master WHERE name = 'jobs'", ())
            if version == 0 and not fresh:
                version = 1  # a file written before user_version was set holds schema 1
            for statements in migrations[version:]:
                for statement in statements:
                    run(statement, ())
            run(f"PRAGMA user_version={len(migrations)}", ())

    @contextmanager
    def transaction(self) -> Iterator[Run]:
        def run(sql: str, parameters: tuple[Any, ...]) -> Rows:
            return self._connection.execute(sql, parameters).fetchall()

        with self._lock:
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield run
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def ping(self) -> bool:
        try:
            with self._lock:
                self._connection.execute("SELECT 1").fetchone()
        except sqlite3.Error:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            self._connection.close()


class PostgresDatabase(Database):
    """A PostgreSQL server shared by every replica, through a psycopg 3 connection pool."""

    now_sql = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
    skip_locked_sql = "FOR UPDATE SKIP LOCKED"
    shared = True

    def __init__(self, url: str, *, max_connections: int) -> None:
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as error:
            raise ImportError(
                "a postgresql:// job database needs psycopg 3 and psycopg_pool: "
                "pip install 'psycopg[binary]' psycopg_pool (both are in the service extra)"
            ) from error
        self._errors: tuple[type[Exception], ...] = (psycopg.Error,)
        self.location = redact_url(url)
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max(1, max_connections),
            open=False,
            timeout=CONNECT_TIMEOUT_S,
            name="planner-jobs",
        )
        try:
            self._pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except Exception as error:
            self._pool.close()
            raise ConnectionError(
                f"could not connect to the job database {self.location} within {CONNECT_TIMEOUT_S:.0f} s "
                f"({type(error).__name__}: {error}); check --db / PLANNER_DB and that the server is up"
            ) from error
        self._migrate()

    def _migrate(self) -> None:
        migrations = _migrations(real="DOUBLE PRECISION", big_integer="BIGINT")
        with self.transaction() as run:
            run("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_ID,))
            run("CREATE TABLE IF NOT EXISTS planner_schema (version INTEGER NOT NULL)", ())
            version = int(run("SELECT COALESCE(MAX(version), 0) FROM planner_schema", ())[0][0])
            for statements in migrations[version:]:
                for statement in statements:
                    run(statement, ())
            if version < len(migrations):
                run("DELETE FROM planner_schema", ())
                run("INSERT INTO planner_schema (version) VALUES (?)", (len(migrations),))

    @contextmanager
    def transaction(self) -> Iterator[Run]:
        with self._pool.connection() as connection, connection.cursor() as cursor:

            def run(sql: str, parameters: tuple[Any, ...]) -> Rows:
                cursor.execute(sql.replace("?", "%s"), parameters)
                return cursor.fetchall() if cursor.description is not None else []

            yield run  # the pool's context commits on a clean exit and rolls back on an exception

    def ping(self) -> bool:
        try:
            self.run("SELECT 1")
        except self._errors:  # psycopg_pool.PoolTimeout is a psycopg.Error too
            return False
        return True

    def close(self) -> None:
        self._pool.close()


def redact_url(url: str) -> str:
    """The URL with its password replaced by `***`, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def open_database(location: str | Path, *, max_connections: int = 4) -> Database:
    """A `postgresql://` URL opens PostgreSQL; anything else is an SQLite file path."""
    text = str(location)
    if text.startswith(POSTGRES_SCHEMES):
        return PostgresDatabase(text, max_connections=max_connections)
    return SqliteDatabase(Path(location))
