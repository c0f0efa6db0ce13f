"""Solving in the background: a bounded pool of threads, and the runner that feeds it stored jobs.

Each worker thread supervises one solve at a time, and the solve itself runs in a child process
(api/solve_process.py) that is killed at PLANNER_SOLVE_TIMEOUT_S or on a cancel. Why bounded: each
queued job holds its graph in memory, so past `queue_size` waiting jobs the service refuses new work
(QueueFull, which the API answers with 503 and Retry-After) instead of growing without limit. Jobs
re-queued after a restart bypass the bound: they were accepted before.

`JobRunner` ties the pool to the `JobStore`: it answers identical requests from the store, stores new
ones, and for each stored job queues one *claim*: a task that claims the oldest claimable job from the
store (NOTE [leases] in api/jobs.py), whichever replica stored it, and solves it. So on PostgreSQL every
replica works through one shared queue, and on SQLite the claims run the jobs in the order they came.
A replica with idle workers also sweeps the shared store for claimable jobs now and then, which is how
the jobs of a replica that died are taken over. For each job in flight the runner keeps one Future that
every waiting request of this replica shares; a request also looks at the store, since another replica
may be the one that solves its job.
This module does not import FastAPI.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from planner.errors import PlannerError
from planner.ir import ActivationGraph, BudgetKind
from planner.serialize import graph_to_dict

from .jobs import TERMINAL, Job, JobError, JobStore, canonical_json, request_key
from .solve_process import ChildEnding, ChildOutcome, run_bounded
from .solve_targets import solve_pareto, solve_plan

__all__ = ["JobFailed", "JobRunner", "PlanJob", "QueueFull", "SolveLimits", "Submission", "WorkerPool"]

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_POLL_S = 0.25
"""How often a waiting request looks at the store for a job that another replica may be solving."""
LEASE_RENEWALS = 3
"""Renewals per lease: a runner renews every lease_s / 3, so two may be late before the lease expires."""
MAX_RENEW_INTERVAL_S = 1.0
"""The longest between two renewals, which is also how long a cancel from another replica takes."""
ABANDON_WAIT_S = 2.0
"""At shutdown, how long to wait for killed solves' threads after the grace period."""


class QueueFull(Exception):
    """The pool's queue holds `capacity` tasks already; try again after `retry_after_s`."""

    def __init__(self, *, capacity: int, retry_after_s: int) -> None:
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        super().__init__(
            f"the solver queue is full ({capacity} jobs waiting); retry in {retry_after_s} s, or run "
            "another service instance"
        )


class JobFailed(PlannerError):
    """A solve finished without an answer; `error` is the recorded reason."""

    def __init__(self, error: JobError) -> None:
        self.error = error
        super().__init__(error.message)


@dataclass
class _Task:
    run: Callable[[], Any]
    future: Future[Any]


class WorkerPool:
    """`workers` threads running tasks from a queue of at most `queue_size` waiting tasks."""

    def __init__(self, *, workers: int, queue_size: int, retry_after_s: int = 5) -> None:
        self.workers = workers
        self.queue_size = queue_size
        self.retry_after_s = retry_after_s
        self._tasks: deque[_Task] = deque()
        self._ready = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._running = 0
        self._stopping = False

    def start(self) -> None:
        for number in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"planner-worker-{number}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, *, timeout_s: float) -> None:
        """Stop taking tasks; wait up to `timeout_s` for running ones. Queued tasks are dropped."""
        with self._ready:
            self._stopping = True
            self._tasks.clear()
            self._ready.notify_all()
        self.join(timeout_s=timeout_s)

    def join(self, *, timeout_s: float) -> None:
        """Wait up to `timeout_s` in all for the threads to end."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    @property
    def queue_depth(self) -> int:
        return len(self._tasks)

    @property
    def busy(self) -> int:
        """Tasks being run right now."""
        return self._running

    @property
    def alive(self) -> int:
        return sum(thread.is_alive() for thread in self._threads)

    def submit(self, run: Callable[[], T], *, bounded: bool = True) -> Future[T]:
        """Queue `run`; raise QueueFull when `bounded` and `queue_size` tasks are already waiting."""
        future: Future[T] = Future()
        with self._ready:
            if self._stopping:
                raise QueueFull(capacity=self.queue_size, retry_after_s=self.retry_after_s)
            if bounded and len(self._tasks) >= self.queue_size:
                raise QueueFull(capacity=self.queue_size, retry_after_s=self.retry_after_s)
            self._tasks.append(_Task(run=run, future=future))
            self._ready.notify()
        return future

    def _next(self) -> _Task | None:
        with self._ready:
            while not self._tasks and not self._stopping:
                self._ready.wait()
            if self._stopping:
                return None
            self._running += 1
            return self._tasks.popleft()

    def _work(self) -> None:
        while (task := self._next()) is not None:
            try:
                if task.future.set_running_or_notify_cancel():
                    try:
                        task.future.set_result(task.run())
                    except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                        task.future.set_exception(error)
            finally:
                with self._ready:
                    self._running -= 1


@dataclass(frozen=True)
class SolveLimits:
    """How long one solve may run, and how jobs are leased (see NOTE [leases] in api/jobs.py)."""

    timeout_s: float = 600.0
    lease_s: float = 30.0
    max_attempts: int = 2

    @property
    def renew_interval_s(self) -> float:
        return min(self.lease_s / LEASE_RENEWALS, MAX_RENEW_INTERVAL_S)


@dataclass(frozen=True)
class PlanJob:
    """A validated plan request: the graph, the budget, what it bounds and the solver's name."""

    graph: ActivationGraph
    budget_bytes: int
    solver: str
    budget_kind: BudgetKind = BudgetKind.ALLOCATED
    allocator_conf: str = ""

    def canonical_json(self) -> str:
        request: dict[str, Any] = {
            "graph": graph_to_dict(self.graph),
            "budget_bytes": self.budget_bytes,
            "solver": self.solver,
        }
        if self.budget_kind is not BudgetKind.ALLOCATED:  # requests made before budget kinds keep their key
            request["budget_kind"] = self.budget_kind.value
            request["allocator_conf"] = self.allocator_conf
        return canonical_json(request)


@dataclass(frozen=True)
class Submission:
    """The job a request maps to; `done` resolves to the finished job (None when already finished)."""

    job: Job
    done: Future[Job] | None
    reused: bool


JobObserver = Callable[[Job, float], None]
"""Called with each finished job and its solve time in seconds (metrics)."""


@dataclass
class _RunningSolve:
    """A job this replica is solving: how to stop it, and when its lease is next renewed."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    renew_at: float = 0.0


def runner_identity() -> str:
    """This process's name in the `owner` column: host, pid (so that tests can find it) and a nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class JobRunner:
    """Stores plan requests as jobs and solves claimed jobs on a WorkerPool, each in a bounded child."""

    def __init__(
        self,
        store: JobStore,
        pool: WorkerPool,
        *,
        limits: SolveLimits | None = None,
        observer: JobObserver | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.limits = limits or SolveLimits()
        self.observer = observer
        self.owner = runner_identity()
        self._lock = threading.RLock()
        """Reentrant: a Future that is already done runs its callback at once."""
        self._futures: dict[str, Future[Job]] = {}
        self._running: dict[str, _RunningSolve] = {}
        self._stopping = threading.Event()

    def submit(self, request: PlanJob) -> Submission:
        """The stored job for an identical request, or a new queued one (QueueFull when none fits)."""
        request_json = request.canonical_json()
        with self._lock:
            existing = self.store.find_reusable(request_key(request_json))
            if existing is not None:
                return Submission(job=existing, done=self._future_of(existing), reused=True)
            if self.pool.queue_depth >= self.pool.queue_size:
                raise QueueFull(capacity=self.pool.queue_size, retry_after_s=self.pool.retry_after_s)
            job = self.store.create(
                request_json=request_json, budget_bytes=request.budget_bytes, solver=request.solver
            )
            done = self._future_of(job)
            self.pool.submit(self._claim_and_solve, bounded=True)
        return Submission(job=job, done=done, reused=False)

    def _future_of(self, job: Job) -> Future[Job] | None:
        if job.status in TERMINAL:
            return None
        return self._futures.setdefault(job.id, Future())

    def settle(self, job: Job) -> None:
        """Resolve the local Future of a finished job (whoever finished it) and forget it."""
        assert job.status in TERMINAL, f"job {job.id} is {job.status.value}, not finished"
        with self._lock:
            done = self._futures.pop(job.id, None)
        if done is not None and not done.done():
            done.set_result(job)

    async def wait(self, job: Job, *, timeout_s: float) -> Job:
        """The job once finished, or as it stands after `timeout_s` (it may be solved by another replica)."""
        with self._lock:
            done = self._future_of(job)
        waiter = asyncio.wrap_future(done) if done is not None else None
        deadline = time.monotonic() + timeout_s
        while job.status not in TERMINAL and (remaining_s := deadline - time.monotonic()) > 0:
            if waiter is not None:
                await asyncio.wait({waiter}, timeout=min(remaining_s, STORE_POLL_S))
            else:
                await asyncio.sleep(min(remaining_s, STORE_POLL_S))
            job = self.store.get(job.id) or job
        if job.status in TERMINAL:
            self.settle(job)
        return job

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued or running job; the job as it stands after (None when unknown)."""
        cancelled = self.store.cancel(
            job_id, reason="cancelled by DELETE /v1/plans/{id} before it finished; post it again to retry"
        )
        with self._lock:
            running = self._running.get(job_id)
        if cancelled and running is not None:
            running.cancelled.set()
        job = self.store.get(job_id)
        if job is not None and job.status in TERMINAL:
            self.settle(job)
        return job

    def recover(self) -> int:
        """Queue again every job a previous process left unfinished; returns how many."""
        job_ids = self.store.recover(max_attempts=self.limits.max_attempts)
        for _ in job_ids:
            self.pool.submit(self._claim_and_solve, bounded=False)
        if job_ids:
            log.info("re-queued %d unfinished job(s) from %s", len(job_ids), self.store.location)
        return len(job_ids)

    def start_sweeping(self) -> None:
        """On a shared store, look for claimable jobs (another replica's, or orphaned) every lease / 4."""
        if not self.store.shared or self.pool.workers == 0:
            return
        threading.Thread(target=self._sweep, name="planner-sweeper", daemon=True).start()

    def _sweep(self) -> None:
        while not self._stopping.wait(self.limits.lease_s / 4):
            idle = self.pool.queue_depth == 0 and self.pool.busy < self.pool.workers
            try:
                if idle and self.store.count_claimable() > 0:
                    self.pool.submit(self._claim_and_solve, bounded=True)
            except QueueFull:  # stopping, or filled by requests since the look: either way, no sweep
                continue
            except Exception:  # noqa: BLE001 - a database hiccup must not end the sweeps; /readyz reports it
                log.exception("sweeping %s for claimable jobs failed", self.store.location)

    def stop(self, *, grace_s: float) -> None:
        """Stop taking jobs, wait up to `grace_s` for running solves, then kill the rest.

        A killed solve stays RUNNING under its lease: another replica takes it once the lease expires,
        and on SQLite the next start re-queues it (`JobStore.recover`).
        """
        self.pool.stop(timeout_s=grace_s)
        self._stopping.set()
        self.pool.join(timeout_s=ABANDON_WAIT_S)

    def pareto(self, request_json: str) -> str:
        """Solve a frontier request in a bounded child: the ParetoView JSON, or JobFailed."""
        outcome = run_bounded(
            solve_pareto,
            request_json,
            timeout_s=self.limits.timeout_s,
            keep_going=lambda: not self._stopping.is_set(),
        )
        if outcome.ending is ChildEnding.ANSWERED and outcome.result_json is not None:
            return outcome.result_json
        raise JobFailed(outcome.error or self._unanswered_error(outcome))

    def _claim_and_solve(self) -> Job | None:
        """Claim the oldest claimable job and solve it; the job as it ends, or None when none waited."""
        try:
            return self._solve_claimed()
        except Exception:  # noqa: BLE001 - logged here: nobody reads a claim's Future
            log.exception("a claim on %s failed; the job stays claimable for a retry", self.store.location)
            raise

    def _solve_claimed(self) -> Job | None:
        job = self.store.claim(
            owner=self.owner, lease_s=self.limits.lease_s, max_attempts=self.limits.max_attempts
        )
        if job is None:
            return None
        running = _RunningSolve(renew_at=time.monotonic() + self.limits.renew_interval_s)
        with self._lock:
            self._running[job.id] = running
        try:
            outcome = run_bounded(
                solve_plan,
                self.store.request_of(job.id),
                timeout_s=self.limits.timeout_s,
                keep_going=lambda: self._keep_going(job.id, running),
            )
        finally:
            with self._lock:
                self._running.pop(job.id, None)
        self._record(job, outcome)
        finished = self.store.get(job.id)
        assert finished is not None, f"job {job.id} vanished from {self.store.location}"
        if finished.status in TERMINAL:
            self.settle(finished)
            if self.observer is not None and outcome.ending is not ChildEnding.STOPPED:
                self.observer(finished, outcome.elapsed_s)
        return finished

    def _keep_going(self, job_id: str, running: _RunningSolve) -> bool:
        if self._stopping.is_set() or running.cancelled.is_set():
            return False
        if time.monotonic() < running.renew_at:
            return True
        running.renew_at = time.monotonic() + self.limits.renew_interval_s
        return self.store.renew(job_id, owner=self.owner, lease_s=self.limits.lease_s)

    def _record(self, job: Job, outcome: ChildOutcome) -> None:
        """Store what the child's ending means for the job (nothing when it was stopped)."""
        if outcome.ending is ChildEnding.STOPPED:
            log.info(
                "job %s stopped after %.1f s (cancelled, taken over or shutting down)",
                job.id,
                outcome.elapsed_s,
            )
            return
        if outcome.result_json is not None:
            stored = self.store.finish(job.id, outcome.result_json, owner=self.owner)
        elif outcome.ending is ChildEnding.CRASHED and job.attempts < self.limits.max_attempts:
            log.warning("the solver process of job %s died (exit %s); retrying it", job.id, outcome.exit_code)
            stored = self.store.requeue(job.id, owner=self.owner)
            if stored:
                self.pool.submit(self._claim_and_solve, bounded=False)
        else:
            error = outcome.error or self._unanswered_error(outcome)
            stored = self.store.fail(job.id, error, owner=self.owner)
        if not stored:
            log.info("job %s was cancelled or taken over while solving; its answer is dropped", job.id)

    def _unanswered_error(self, outcome: ChildOutcome) -> JobError:
        if outcome.ending is ChildEnding.TIMED_OUT:
            return JobError(
                type="timed_out",
                message=f"the solve ran past the time limit of {self.limits.timeout_s:g} s "
                "(PLANNER_SOLVE_TIMEOUT_S) and was stopped; try solver='dp' or 'chen', which are faster "
                "than 'ilp' and 'auto', a coarser graph, or a service with a higher limit",
            )
        return JobError(
            type="worker_crashed",
            message=f"the solver process died (exit status {outcome.exit_code}; a negative one is the "
            "signal that killed it) and the job was not retried again (PLANNER_MAX_ATTEMPTS); it may "
            "have run out of memory: solve the graph locally with planner.plan_graph to see",
        )
