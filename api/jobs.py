"""The job store: every plan request, its state and its result, in one SQLite file (stdlib sqlite3).

Why SQLite: jobs must outlive the process (a finished plan survives a restart; a job that was running
when the process died is found and run again, or marked failed with the reason), identical requests
must be answered from what was already solved, and the service must run as one container with no
database server beside it. Requests and results are stored as JSON text and read back with
`json.loads`; nothing is ever unpickled.

A job's key is the SHA-256 of its canonical request JSON (the graph as `graph_to_dict` writes it, the
budget and the solver, keys sorted, no whitespace): two requests with the same key ask the same
question, so the second gets the first one's job. Failures that would repeat (an infeasible budget)
are reused too; failures that might not (a restart, a bug) are not.

NOTE [one connection]: one connection is shared by the event loop and the worker threads, serialised by
a lock. Statements are short (a row by primary key), so the lock is never held for long, and
WAL journaling with synchronous=NORMAL keeps every committed transaction across a process crash.
This module does not import FastAPI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from planner.errors import InfeasibleBudget, InvalidGraph, PlannerError

__all__ = ["Job", "JobError", "JobStatus", "JobStore", "canonical_json", "request_key"]

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    request_key TEXT NOT NULL,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    budget_bytes INTEGER NOT NULL,
    solver TEXT NOT NULL,
    result TEXT,
    error TEXT,
    reusable INTEGER NOT NULL DEFAULT 1,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_key ON jobs (request_key, created_at);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, created_at);
"""


class JobStatus(Enum):
    """Where a job is in its life."""

    QUEUED = "queued"
    """Stored and waiting for a worker (also after a restart re-queued it)."""
    RUNNING = "running"
    """A worker is solving it."""
    DONE = "done"
    """Solved; the plan is stored."""
    FAILED = "failed"
    """Finished without a plan; the error says why."""


TERMINAL = frozenset({JobStatus.DONE, JobStatus.FAILED})


@dataclass(frozen=True)
class JobError:
    """Why a job failed, in the words the client shows its user."""

    type: str
    """`infeasible_budget`, `invalid_graph`, `planner_error`, `interrupted` or `internal_error`."""
    message: str
    budget_bytes: int | None = None
    min_peak_bytes: int | None = None
    breakdown: dict[str, int] | None = None

    @classmethod
    def from_exception(cls, error: BaseException) -> JobError:
        if isinstance(error, InfeasibleBudget):
            return cls(
                type="infeasible_budget",
                message=str(error),
                budget_bytes=error.budget_bytes,
                min_peak_bytes=error.min_peak_bytes,
                breakdown=dict(error.breakdown),
            )
        if isinstance(error, InvalidGraph):
            return cls(type="invalid_graph", message=str(error))
        if isinstance(error, PlannerError):
            return cls(type="planner_error", message=str(error))
        return cls(
            type="internal_error",
            message=f"the solver failed with {type(error).__name__}: {error}. This is a bug in the "
            "planner; please report it with the graph that caused it",
        )

    @property
    def repeats(self) -> bool:
        """True when solving the same request again would fail the same way."""
        return self.type in {"infeasible_budget", "invalid_graph", "planner_error"}


@dataclass(frozen=True)
class Job:
    """One stored plan request and what became of it."""

    id: str
    key: str
    status: JobStatus
    budget_bytes: int
    solver: str
    attempts: int
    created_at: float
    updated_at: float
    result_json: str | None
    """The plan (`planner.plan/v1`) as JSON text, once DONE."""
    error: JobError | None


def canonical_json(document: Any) -> str:
    """JSON with sorted keys and no whitespace: equal documents give equal text (and keys)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)


def request_key(request_json: str) -> str:
    """The job key of a canonical request: the SHA-256 of its text."""
    return hashlib.sha256(request_json.encode()).hexdigest()


_COLUMNS = "id, request_key, status, budget_bytes, solver, attempts, created_at, updated_at, result, error"


def _job_from_row(row: tuple[Any, ...]) -> Job:
    job_id, key, status, budget_bytes, solver, attempts, created_at, updated_at, result, error = row
    return Job(
        id=job_id,
        key=key,
        status=JobStatus(status),
        budget_bytes=budget_bytes,
        solver=solver,
        attempts=attempts,
        created_at=created_at,
        updated_at=updated_at,
        result_json=result,
        error=JobError(**json.loads(error)) if error else None,
    )


class JobStore:
    """Jobs in a SQLite file; safe to share between threads (see NOTE [one connection])."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=NORMAL")
            self._connection.executescript(_SCHEMA)
            self._connection.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._connection.close()

    def ping(self) -> bool:
        """True when the database answers a query (for readiness checks)."""
        try:
            with self._lock:
                self._connection.execute("SELECT 1").fetchone()
        except sqlite3.Error:
            return False
        return True

    def _one(self, sql: str, parameters: tuple[Any, ...]) -> Job | None:
        with self._lock:
            row = self._connection.execute(sql, parameters).fetchone()
        return _job_from_row(row) if row else None

    def get(self, job_id: str) -> Job | None:
        return self._one(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,))

    def find_reusable(self, key: str) -> Job | None:
        """The newest job with this key whose answer still holds (not a failure that might not repeat)."""
        return self._one(
            f"SELECT {_COLUMNS} FROM jobs WHERE request_key = ? AND (status != ? OR reusable = 1) "
            "ORDER BY created_at DESC LIMIT 1",
            (key, JobStatus.FAILED.value),
        )

    def create(self, *, request_json: str, budget_bytes: int, solver: str) -> Job:
        """Store a new QUEUED job for a canonical request."""
        now = time.time()
        job_id = uuid.uuid4().hex
        with self._lock:
            self._connection.execute(
                "INSERT INTO jobs (id, request_key, status, request, budget_bytes, solver, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    request_key(request_json),
                    JobStatus.QUEUED.value,
                    request_json,
                    budget_bytes,
                    solver,
                    now,
                    now,
                ),
            )
        job = self.get(job_id)
        assert job is not None, f"job {job_id} vanished right after it was stored"
        return job

    def request_of(self, job_id: str) -> str:
        """The canonical request JSON of a job."""
        with self._lock:
            row = self._connection.execute("SELECT request FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(f"no job {job_id!r} in {self.path}")
        return str(row[0])

    def start(self, job_id: str) -> bool:
        """Move a QUEUED job to RUNNING and count the attempt; False when it was not queued."""
        with self._lock:
            cursor = self._connection.execute(
                "UPDATE jobs SET status = ?, attempts = attempts + 1, updated_at = ? "
                "WHERE id = ? AND status = ?",
                (JobStatus.RUNNING.value, time.time(), job_id, JobStatus.QUEUED.value),
            )
        return cursor.rowcount == 1

    def finish(self, job_id: str, result_json: str) -> None:
        with self._lock:
            self._connection.execute(
                "UPDATE jobs SET status = ?, result = ?, updated_at = ? WHERE id = ?",
                (JobStatus.DONE.value, result_json, time.time(), job_id),
            )

    def fail(self, job_id: str, error: JobError) -> None:
        with self._lock:
            self._connection.execute(
                "UPDATE jobs SET status = ?, error = ?, reusable = ?, updated_at = ? WHERE id = ?",
                (
                    JobStatus.FAILED.value,
                    json.dumps(dataclasses.asdict(error)),
                    int(error.repeats),
                    time.time(),
                    job_id,
                ),
            )

    def recover(self, *, max_attempts: int) -> list[str]:
        """After a restart: re-queue jobs that were running, or fail them after `max_attempts` starts.

        Returns the ids of every QUEUED job, oldest first, for the caller to hand to its workers.
        """
        interrupted = JobError(
            type="interrupted",
            message=f"the service stopped while solving this job {max_attempts} time(s); it is not "
            "retried again. Post the request again to retry, or solve the graph locally with "
            "planner.plan_graph to see whether it is the cause",
        )
        now = time.time()
        with self._lock:
            self._connection.execute("BEGIN IMMEDIATE")
            self._connection.execute(
                "UPDATE jobs SET status = ?, error = ?, reusable = 0, updated_at = ? "
                "WHERE status = ? AND attempts >= ?",
                (
                    JobStatus.FAILED.value,
                    json.dumps(dataclasses.asdict(interrupted)),
                    now,
                    JobStatus.RUNNING.value,
                    max_attempts,
                ),
            )
            self._connection.execute(
                "UPDATE jobs SET status = ?, updated_at = ? WHERE status = ?",
                (JobStatus.QUEUED.value, now, JobStatus.RUNNING.value),
            )
            self._connection.execute("COMMIT")
            rows = self._connection.execute(
                "SELECT id FROM jobs WHERE status = ? ORDER BY created_at", (JobStatus.QUEUED.value,)
            ).fetchall()
        return [row[0] for row in rows]

    def count_by_status(self) -> dict[JobStatus, int]:
        with self._lock:
            rows = self._connection.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        counts = dict.fromkeys(JobStatus, 0)
        counts.update({JobStatus(status): count for status, count in rows})
        return counts
