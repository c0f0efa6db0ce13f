"""Solving in the background: a bounded pool of threads, and the runner that feeds it stored jobs.

Why threads and not processes: a solve is pure Python on plain data, and a process pool would have to
pickle graphs between processes; threads share the parsed graph and the solvers' tables, and nothing is
ever unpickled. Why bounded: each queued job holds its graph in memory, so past `queue_size` waiting
jobs the service refuses new work (QueueFull, which the API answers with 503 and Retry-After) instead
of growing without limit. Jobs re-queued after a restart bypass the bound: they were accepted before.

`JobRunner` ties the pool to the `JobStore`: it answers identical requests from the store, stores new
ones, and for each job in flight keeps one Future that every waiting request shares.
This module does not import FastAPI.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from api.jobs import TERMINAL, Job, JobError, JobStore, canonical_json, request_key
from planner.errors import PlannerError
from planner.ir import ActivationGraph
from planner.serialize import graph_from_dict, graph_to_dict
from planner.solving import plan_graph

__all__ = ["JobFailed", "JobRunner", "PlanJob", "QueueFull", "Submission", "WorkerPool"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
class PlanJob:
    """A validated plan request: the graph, the budget and the solver's name."""

    graph: ActivationGraph
    budget_bytes: int
    solver: str

    def canonical_json(self) -> str:
        return canonical_json(
            {"graph": graph_to_dict(self.graph), "budget_bytes": self.budget_bytes, "solver": self.solver}
        )


@dataclass(frozen=True)
class Submission:
    """The job a request maps to; `done` resolves to the finished job (None when already finished)."""

    job: Job
    done: Future[Job] | None
    reused: bool


JobObserver = Callable[[Job, float], None]
"""Called with each finished job and its solve time in seconds (metrics)."""


class JobRunner:
    """Stores plan requests as jobs and solves them on a WorkerPool, one Future per job in flight."""

    def __init__(self, store: JobStore, pool: WorkerPool, *, observer: JobObserver | None = None) -> None:
        self.store = store
        self.pool = pool
        self.observer = observer
        self._lock = threading.RLock()
        """Reentrant: a Future that is already done runs its callback (`_forget`) at once."""
        self._in_flight: dict[str, Future[Job]] = {}

    def submit(self, request: PlanJob) -> Submission:
        """The stored job for an identical request, or a new queued one (QueueFull when none fits)."""
        request_json = request.canonical_json()
        with self._lock:
            existing = self.store.find_reusable(request_key(request_json))
            if existing is not None:
                return Submission(job=existing, done=self._in_flight.get(existing.id), reused=True)
            if self.pool.queue_depth >= self.pool.queue_size:
                raise QueueFull(capacity=self.pool.queue_size, retry_after_s=self.pool.retry_after_s)
            job = self.store.create(
                request_json=request_json, budget_bytes=request.budget_bytes, solver=request.solver
            )
            done = self._enqueue(job.id, bounded=True)
        return Submission(job=job, done=done, reused=False)

    def recover(self, *, max_attempts: int) -> int:
        """Queue again every job a previous process left unfinished; returns how many."""
        job_ids = self.store.recover(max_attempts=max_attempts)
        with self._lock:
            for job_id in job_ids:
                self._enqueue(job_id, bounded=False)
        if job_ids:
            log.info("re-queued %d unfinished job(s) from %s", len(job_ids), self.store.path)
        return len(job_ids)

    def _enqueue(self, job_id: str, *, bounded: bool) -> Future[Job]:
        done = self.pool.submit(lambda: self._run(job_id), bounded=bounded)
        self._in_flight[job_id] = done
        done.add_done_callback(lambda _: self._forget(job_id))
        return done

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._in_flight.pop(job_id, None)

    def _run(self, job_id: str) -> Job:
        if not self.store.start(job_id):
            job = self.store.get(job_id)
            assert job is not None, f"job {job_id} was queued but is not in the store"
            return job
        started = time.perf_counter()
        request = json.loads(self.store.request_of(job_id))
        try:
            plan = plan_graph(
                graph_from_dict(request["graph"]),
                budget_bytes=int(request["budget_bytes"]),
                solver=str(request["solver"]),
            )
            self.store.finish(job_id, json.dumps(plan.to_dict(), separators=(",", ":"), allow_nan=False))
        except Exception as error:  # noqa: BLE001 - every failure is stored on the job, bugs included
            if not isinstance(error, PlannerError):
                log.exception("job %s failed unexpectedly", job_id)
            self.store.fail(job_id, JobError.from_exception(error))
        job = self.store.get(job_id)
        assert job is not None and job.status in TERMINAL, f"job {job_id} did not finish: {job}"
        if self.observer is not None:
            self.observer(job, time.perf_counter() - started)
        return job
