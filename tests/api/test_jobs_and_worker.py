"""The job store and the worker pool on their own: no FastAPI, no HTTP."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from planner_service.jobs import JobError, JobStatus, JobStore, canonical_json, request_key
from planner_service.worker import JobRunner, PlanJob, QueueFull, WorkerPool
from tests.api.service_helpers import middle_budget, small_graph

REQUEST = canonical_json({"graph": {"schema": "planner.graph/v1"}, "budget_bytes": 5, "solver": "dp"})
OWNER = "test-runner"
LEASE_S = 30.0


def test_jobs_and_worker_do_not_import_fastapi() -> None:
    code = (
        "import sys, planner_service.jobs, planner_service.worker; "
        "sys.exit('fastapi' in sys.modules or 'starlette' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_job_goes_from_queued_to_done_and_survives_reopening(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    job = store.create(request_json=REQUEST, budget_bytes=5, solver="dp")
    assert job.status is JobStatus.QUEUED and job.key == request_key(REQUEST)
    claimed = store.claim(owner=OWNER, lease_s=LEASE_S, max_attempts=2)
    assert claimed is not None and claimed.id == job.id and claimed.status is JobStatus.RUNNING
    assert store.claim(owner=OWNER, lease_s=LEASE_S, max_attempts=2) is None, "a job is claimed once"
    assert not store.finish(job.id, "{}", owner="someone-else"), "only the job's owner may finish it"
    assert store.finish(job.id, '{"schema": "planner.plan/v1"}', owner=OWNER)
    store.close()
    reopened = JobStore(tmp_path / "jobs.sqlite3")
    done = reopened.get(job.id)
    assert done is not None and done.status is JobStatus.DONE and done.attempts == 1
    assert done.result_json == '{"schema": "planner.plan/v1"}' and reopened.request_of(job.id) == REQUEST
    assert reopened.find_reusable(job.key) == done
    reopened.close()


def test_failures_that_repeat_are_reused_and_others_are_not(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    infeasible = store.create(request_json=REQUEST, budget_bytes=5, solver="dp")
    store.claim(owner=OWNER, lease_s=LEASE_S, max_attempts=2)
    store.fail(
        infeasible.id,
        JobError(type="infeasible_budget", message="no", budget_bytes=5, min_peak_bytes=9),
        owner=OWNER,
    )
    reused = store.find_reusable(request_key(REQUEST))
    assert reused is not None and reused.id == infeasible.id and reused.error is not None
    assert reused.error.min_peak_bytes == 9
    other = canonical_json({"x": 1})
    crashed = store.create(request_json=other, budget_bytes=5, solver="dp")
    store.claim(owner=OWNER, lease_s=LEASE_S, max_attempts=2)
    store.fail(crashed.id, JobError.from_exception(RuntimeError("boom")), owner=OWNER)
    assert store.find_reusable(request_key(other)) is None, "a bug's failure is not an answer"
    store.close()


def test_recover_requeues_running_jobs_and_fails_them_after_max_attempts(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    job = store.create(request_json=REQUEST, budget_bytes=5, solver="dp")
    queued = store.create(request_json=canonical_json({"y": 2}), budget_bytes=5, solver="dp")
    store.claim(owner=OWNER, lease_s=LEASE_S, max_attempts=2)
    assert store.recover(max_attempts=2) == [job.id, queued.id], (
        "running and queued jobs run again, oldest first, whatever their lease says (SQLite)"
    )
    store.claim(owner=OWNER, lease_s=LEASE_S, max_attempts=2)
    assert store.recover(max_attempts=2) == [queued.id]
    failed = store.get(job.id)
    assert failed is not None and failed.status is JobStatus.FAILED and failed.error is not None
    assert failed.error.type == "interrupted" and "stopped while solving" in failed.error.message
    assert store.find_reusable(job.key) is None, "an interrupted job is retried when posted again"
    assert store.count_by_status()[JobStatus.FAILED] == 1
    store.close()


def test_the_pool_is_bounded_and_hands_results_and_errors_to_futures() -> None:
    release = threading.Event()
    pool = WorkerPool(workers=1, queue_size=1, retry_after_s=3)
    pool.start()
    blocking = pool.submit(release.wait)
    deadline = time.monotonic() + 5
    while pool.busy == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = pool.submit(lambda: 1 / 0)
    with pytest.raises(QueueFull, match="retry in 3 s") as caught:
        pool.submit(lambda: None)
    assert caught.value.capacity == 1
    overflow = pool.submit(lambda: "recovered", bounded=False)
    release.set()
    assert blocking.result(timeout=5) is True and overflow.result(timeout=5) == "recovered"
    with pytest.raises(ZeroDivisionError):
        waiting.result(timeout=5)
    pool.stop(timeout_s=5)
    assert pool.alive == 0


def test_identical_submissions_share_one_job_and_one_future(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    pool = WorkerPool(workers=1, queue_size=4)
    runner = JobRunner(store, pool)
    graph = small_graph()
    request = PlanJob(graph=graph, budget_bytes=middle_budget(graph), solver="dp")
    first = runner.submit(request)
    second = runner.submit(request)
    assert second.reused and second.job.id == first.job.id
    assert second.done is first.done, "a job in flight has one future that every waiter shares"
    pool.start()
    assert first.done is not None
    finished = first.done.result(timeout=30)
    assert finished.status is JobStatus.DONE and finished.result_json is not None
    third = runner.submit(request)
    assert third.reused and third.done is None and third.job.status is JobStatus.DONE
    pool.stop(timeout_s=5)
    store.close()


def test_a_database_from_before_leases_is_migrated_and_its_running_job_recovered(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    with sqlite3.connect(path) as old:  # schema 1, as the service wrote it before leases existed
        old.executescript(
            "CREATE TABLE jobs (id TEXT PRIMARY KEY, request_key TEXT NOT NULL, status TEXT NOT NULL, "
            "request TEXT NOT NULL, budget_bytes INTEGER NOT NULL, solver TEXT NOT NULL, result TEXT, "
            "error TEXT, reusable INTEGER NOT NULL DEFAULT 1, attempts INTEGER NOT NULL DEFAULT 0, "
            "created_at REAL NOT NULL, updated_at REAL NOT NULL); PRAGMA user_version=1;"
        )
        old.execute(
            "INSERT INTO jobs (id, request_key, status, request, budget_bytes, solver, attempts, created_at, "
            "updated_at) VALUES ('old', ?, 'running', ?, 5, 'dp', 1, 1.0, 1.0)",
            (request_key(REQUEST), REQUEST),
        )
    store = JobStore(path)
    assert store.recover(max_attempts=2) == ["old"]
    claimed = store.claim(owner=OWNER, lease_s=LEASE_S, max_attempts=2)
    store.close()
    assert claimed is not None and claimed.id == "old" and claimed.attempts == 2
    with sqlite3.connect(path) as reopened:
        assert reopened.execute("PRAGMA user_version").fetchone() == (2,)
