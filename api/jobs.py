"""The job store: every plan request, its state and its result, in SQLite or PostgreSQL (api/databases.py).

Why a database: jobs must outlive the process (a finished plan survives a restart; a job whose runner
died is found and run again, or marked failed with the reason), and identical requests must be answered
from what was already solved. SQLite (a file, the default) serves one machine with no database server
beside it; PostgreSQL (`--db postgresql://...`) lets any number of replicas share the jobs. Requests and
results are stored as JSON text and read back with `json.loads`; nothing is ever unpickled.

A job's key is the SHA-256 of its canonical request JSON (the graph as `graph_to_dict` writes it, the
budget and the solver, keys sorted, no whitespace): two requests with the same key ask the same
question, so the second gets the first one's job. Failures that would repeat (an infeasible budget)
are reused too; failures that might not (a restart, a timeout, a cancel, a bug) are not.

NOTE [leases]: a runner *claims* a job (QUEUED -> RUNNING, attempts + 1, `owner` = the runner, a lease
until now + `lease_s`) and renews the lease while it solves. Every later write of that runner names its
`owner` and lands only while the job is still RUNNING under it: a job cancelled meanwhile, or taken over
after the lease expired, ignores a late answer. A RUNNING job whose lease expired is claimable again, so
the replica that died holding it is replaced by whichever claims next; after `max_attempts` starts it is
failed as `interrupted` instead. `owner` stays on a finished job: it names the runner that last held it.
On SQLite one process owns the file, so at start every RUNNING job is an orphan (`recover`), whatever
its lease says.
This module does not import FastAPI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from planner.errors import InfeasibleBudget, InvalidGraph, PlannerError
from planner.ir import breakdown_to_json

from .databases import Database, Rows, Run, open_database

__all__ = ["Job", "JobError", "JobStatus", "JobStore", "canonical_json", "request_key"]


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
    """`infeasible_budget`, `invalid_graph`, `planner_error` (the request's fault); `timed_out` (past
    PLANNER_SOLVE_TIMEOUT_S), `cancelled` (DELETE); `interrupted` (runners died `max_attempts` times),
    `worker_crashed` (its solver process died, e.g. out of memory), `internal_error` (a bug)."""
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
                breakdown=breakdown_to_json(error.breakdown),
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

    @property
    def http_status(self) -> int:
        """How a POST that waited for this job answers: 422 the request's fault, 409 cancelled, else 500."""
        if self.repeats or self.type == "timed_out":
            return 422
        if self.type == "cancelled":
            return 409
        return 500


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
    """Jobs in a database (`open_database`: an SQLite path or a `postgresql://` URL); thread-safe.

    Life of a job: `create` (QUEUED) -> `claim` (RUNNING, leased; see NOTE [leases]) -> `renew` while
    solving -> `finish` (DONE) or `fail` (FAILED), or `requeue` after its solver process crashed.
    `cancel` fails a QUEUED or RUNNING job from anywhere.
    """

    def __init__(self, location: Path | str, *, max_connections: int = 4) -> None:
        self.database: Database = open_database(location, max_connections=max_connections)
        self._now = self.database.now_sql

    @property
    def location(self) -> str:
        """The file or URL (without its password) holding the jobs."""
        return self.database.location

    @property
    def shared(self) -> bool:
        """True when other replicas may claim the same jobs (PostgreSQL)."""
        return self.database.shared

    def close(self) -> None:
        self.database.close()

    def ping(self) -> bool:
        """True when the database answers a query (for readiness checks)."""
        return self.database.ping()

    def _one(self, rows: Rows) -> Job | None:
        return _job_from_row(rows[0]) if rows else None

    def get(self, job_id: str) -> Job | None:
        return self._one(self.database.run(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)))

    def find_reusable(self, key: str) -> Job | None:
        """The newest job with this key whose answer still holds (not a failure that might not repeat)."""
        return self._one(
            self.database.run(
                f"SELECT {_COLUMNS} FROM jobs WHERE request_key = ? AND (status != ? OR reusable = 1) "
                "ORDER BY created_at DESC LIMIT 1",
                (key, JobStatus.FAILED.value),
            )
        )

    def create(self, *, request_json: str, budget_bytes: int, solver: str) -> Job:
        """Store a new QUEUED job for a canonical request."""
        rows = self.database.run(
            "INSERT INTO jobs (id, request_key, status, request, budget_bytes, solver, created_at, "
            f"updated_at) VALUES (?, ?, ?, ?, ?, ?, {self._now}, {self._now}) RETURNING {_COLUMNS}",
            (
                uuid.uuid4().hex,
                request_key(request_json),
                JobStatus.QUEUED.value,
                request_json,
                budget_bytes,
                solver,
            ),
        )
        job = self._one(rows)
        assert job is not None, "INSERT ... RETURNING gave no row"
        return job

    def request_of(self, job_id: str) -> str:
        """The canonical request JSON of a job."""
        rows = self.database.run("SELECT request FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            raise KeyError(f"no job {job_id!r} in {self.location}")
        return str(rows[0][0])

    def claim(self, *, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        """The oldest claimable job, now RUNNING under `owner` until the lease ends; None when none waits.

        Claimable: QUEUED, or RUNNING with an expired lease (its runner died). Expired jobs already
        started `max_attempts` times are failed as `interrupted` first (see NOTE [leases]).
        """
        with self.database.transaction() as run:
            self._fail_interrupted(run, max_attempts=max_attempts, expired_only=True)
            rows = run(
                f"UPDATE jobs SET status = ?, attempts = attempts + 1, owner = ?, "
                f"lease_expires_at = {self._now} + ?, updated_at = {self._now} "
                f"WHERE id = (SELECT id FROM jobs WHERE {self._claimable} "
                f"ORDER BY created_at LIMIT 1 {self.database.skip_locked_sql}) RETURNING {_COLUMNS}",
                (JobStatus.RUNNING.value, owner, lease_s, JobStatus.QUEUED.value, JobStatus.RUNNING.value),
            )
        return self._one(rows)

    @property
    def _claimable(self) -> str:
        """SQL condition of a claimable job; takes the parameters (QUEUED, RUNNING)."""
        return f"(status = ? OR (status = ? AND lease_expires_at < {self._now}))"

    def count_claimable(self) -> int:
        """Jobs a runner could claim now (queued, or running on a lease that expired)."""
        rows = self.database.run(
            f"SELECT COUNT(*) FROM jobs WHERE {self._claimable}",
            (JobStatus.QUEUED.value, JobStatus.RUNNING.value),
        )
        return int(rows[0][0])

    def _owned_update(self, job_id: str, *, owner: str, assignments: str, values: tuple[Any, ...]) -> bool:
        """Apply `assignments` while the job is RUNNING under `owner`; False when it no longer is."""
        rows = self.database.run(
            f"UPDATE jobs SET {assignments}, updated_at = {self._now} "
            "WHERE id = ? AND owner = ? AND status = ? RETURNING id",
            (*values, job_id, owner, JobStatus.RUNNING.value),
        )
        return bool(rows)

    def renew(self, job_id: str, *, owner: str, lease_s: float) -> bool:
        """Extend the lease by `lease_s`; False when the job was cancelled or taken over meanwhile."""
        return self._owned_update(
            job_id, owner=owner, assignments=f"lease_expires_at = {self._now} + ?", values=(lease_s,)
        )

    def finish(self, job_id: str, result_json: str, *, owner: str) -> bool:
        """Store the plan (DONE); False when `owner` no longer holds the job (the answer is dropped)."""
        return self._owned_update(
            job_id,
            owner=owner,
            assignments="status = ?, result = ?, lease_expires_at = NULL",
            values=(JobStatus.DONE.value, result_json),
        )

    def fail(self, job_id: str, error: JobError, *, owner: str) -> bool:
        """Record the failure (FAILED); False when `owner` no longer holds the job."""
        return self._owned_update(
            job_id,
            owner=owner,
            assignments="status = ?, error = ?, reusable = ?, lease_expires_at = NULL",
            values=(JobStatus.FAILED.value, _error_json(error), int(error.repeats)),
        )

    def requeue(self, job_id: str, *, owner: str) -> bool:
        """Put a job whose solver process died back in the queue (its attempt stays counted)."""
        return self._owned_update(
            job_id,
            owner=owner,
            assignments="status = ?, lease_expires_at = NULL",
            values=(JobStatus.QUEUED.value,),
        )

    def cancel(self, job_id: str, *, reason: str) -> bool:
        """Fail a QUEUED or RUNNING job as `cancelled`; False when it is unknown or already finished.

        A runner solving it finds out at its next `renew` and stops (NOTE [leases]).
        """
        error = JobError(type="cancelled", message=reason)
        rows = self.database.run(
            f"UPDATE jobs SET status = ?, error = ?, reusable = 0, lease_expires_at = NULL, "
            f"updated_at = {self._now} WHERE id = ? AND status IN (?, ?) RETURNING id",
            (
                JobStatus.FAILED.value,
                _error_json(error),
                job_id,
                JobStatus.QUEUED.value,
                JobStatus.RUNNING.value,
            ),
        )
        return bool(rows)

    def _fail_interrupted(self, run: Run, *, max_attempts: int, expired_only: bool) -> None:
        interrupted = JobError(
            type="interrupted",
            message=f"the service stopped while solving this job {max_attempts} time(s); it is not "
            "retried again. Post the request again to retry, or solve the graph locally with "
            "planner.plan_graph to see whether it is the cause",
        )
        run(
            f"UPDATE jobs SET status = ?, error = ?, reusable = 0, lease_expires_at = NULL, "
            f"updated_at = {self._now} WHERE status = ? AND attempts >= ? "
            f"AND (lease_expires_at < {self._now} OR ?)",
            (
                JobStatus.FAILED.value,
                _error_json(interrupted),
                JobStatus.RUNNING.value,
                max_attempts,
                not expired_only,
            ),
        )

    def recover(self, *, max_attempts: int) -> list[str]:
        """At start: fail orphaned RUNNING jobs started `max_attempts` times, re-queue the others.

        Orphaned: every RUNNING job on SQLite (this process owns the file), and on PostgreSQL those
        whose lease expired (the others belong to live replicas). Returns the ids of every claimable
        job, oldest first, for the caller to hand to its workers.
        """
        expired_only = self.shared
        with self.database.transaction() as run:
            self._fail_interrupted(run, max_attempts=max_attempts, expired_only=expired_only)
            run(
                f"UPDATE jobs SET status = ?, lease_expires_at = NULL, "
                f"updated_at = {self._now} WHERE status = ? AND (lease_expires_at < {self._now} OR ?)",
                (JobStatus.QUEUED.value, JobStatus.RUNNING.value, not expired_only),
            )
            rows = run("SELECT id FROM jobs WHERE status = ? ORDER BY created_at", (JobStatus.QUEUED.value,))
        return [row[0] for row in rows]

    def count_by_status(self) -> dict[JobStatus, int]:
        rows = self.database.run("SELECT status, COUNT(*) FROM jobs GROUP BY status")
        counts = dict.fromkeys(JobStatus, 0)
        counts.update({JobStatus(status): count for status, count in rows})
        return counts


def _error_json(error: JobError) -> str:
    return json.dumps(dataclasses.asdict(error))
