"""Bounded solves on both stores (SQLite and PostgreSQL): time limits, cancels, crashed solver processes,
and the store's claims and leases that replicas rely on.

The slow solve is honest work: `ilp` on a 41-node graph, whose CP-SAT search runs about 9 s on the
project's 2-core machine (it stops at ILP_TIME_LIMIT_S = 10 s), far past the limits set here.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from planner_service import solve_targets
from planner_service.jobs import JobStatus, JobStore, canonical_json
from planner_service.main import create_app
from planner_service.settings import Settings
from planner_service.solve_process import PRELOADED_MODULES
from tests.api.service_helpers import (
    SLOW_BUDGET_BYTES,
    middle_budget,
    plan_body,
    slow_body,
    small_graph,
    solver_children,
    wait_until,
)

QUICK_GRAPH = small_graph()
QUICK_BUDGET_BYTES = middle_budget(QUICK_GRAPH)


def job_in(
    client: TestClient, job_id: str, status: str, attempts: int | None = None
) -> dict[str, Any] | None:
    job: dict[str, Any] = client.get(f"/v1/plans/{job_id}").json()
    matches = job["status"] == status and (attempts is None or job["attempts"] == attempts)
    return job if matches else None


def test_the_forkserver_preloads_the_module_the_solves_run_from() -> None:
    # The forkserver ignores an ImportError in its preload: a wrong name (api.solve_targets, the folder's
    # name) would pass every other test and only make each solve import the solvers again.
    preloaded = [importlib.import_module(name) for name in PRELOADED_MODULES]
    assert solve_targets in preloaded, PRELOADED_MODULES


def test_a_solve_past_the_time_limit_fails_with_its_reason_and_frees_its_worker(database: str) -> None:
    app = create_app(Settings(db=database, workers=1, solve_timeout_s=1.0))
    with TestClient(app) as client:
        started = time.monotonic()
        slow = client.post("/v1/plans", json=slow_body(wait_s=20))
        elapsed_s = time.monotonic() - started
        quick = client.post("/v1/plans", json=plan_body(QUICK_GRAPH, QUICK_BUDGET_BYTES, wait_s=20))
    assert slow.status_code == 422, slow.text
    error = slow.json()["detail"][0]
    assert error["type"] == "timed_out" and "time limit of 1 s (PLANNER_SOLVE_TIMEOUT_S)" in error["msg"]
    assert elapsed_s < 5, f"the solve was stopped at its limit, not run to its end ({elapsed_s:.1f} s)"
    assert quick.status_code == 200 and quick.json()["status"] == "done", "the one worker is free again"


def test_cancel_stops_queued_and_running_jobs(database: str) -> None:
    app = create_app(Settings(db=database, workers=1))
    with TestClient(app) as client:
        running = client.post("/v1/plans", json=slow_body(wait_s=0)).json()
        queued = client.post("/v1/plans", json=slow_body(SLOW_BUDGET_BYTES + 1, wait_s=0)).json()
        wait_until(lambda: job_in(client, running["id"], "running"), "the first job runs")
        assert client.get(f"/v1/plans/{queued['id']}").json()["status"] == "queued", "one worker: it waits"

        cancelled_queued = client.delete(f"/v1/plans/{queued['id']}")
        cancelled_running = client.delete(f"/v1/plans/{running['id']}")
        started = time.monotonic()
        quick = client.post("/v1/plans", json=plan_body(QUICK_GRAPH, QUICK_BUDGET_BYTES, wait_s=20))
        freed_after_s = time.monotonic() - started
        finished = client.delete(f"/v1/plans/{quick.json()['id']}")
        unknown = client.delete("/v1/plans/no-such-job")
        time.sleep(0.5)  # room for a late answer of the killed solve, which must not land
        running_after = client.get(f"/v1/plans/{running['id']}").json()
        posted_again = client.post("/v1/plans", json=slow_body(SLOW_BUDGET_BYTES + 1, wait_s=0)).json()
        client.delete(f"/v1/plans/{posted_again['id']}")
    for answer in (cancelled_queued, cancelled_running):
        assert answer.status_code == 200, answer.text
        job = answer.json()
        assert job["status"] == "failed" and job["error"]["type"] == "cancelled"
        assert "DELETE" in job["error"]["message"]
    assert quick.status_code == 200 and freed_after_s < 5, f"the worker was freed ({freed_after_s:.1f} s)"
    assert finished.status_code == 409 and "already finished (done)" in finished.json()["detail"][0]["msg"]
    assert unknown.status_code == 404
    assert running_after["status"] == "failed" and running_after["error"]["type"] == "cancelled"
    assert posted_again["id"] != queued["id"], "a cancelled job is not an answer: posting again retries"


def test_a_crashed_solver_process_is_retried_up_to_the_attempt_limit(database: str) -> None:
    app = create_app(Settings(db=database, workers=1, max_attempts=2))
    with TestClient(app) as client:
        job_id = client.post("/v1/plans", json=slow_body(wait_s=0)).json()["id"]
        for attempt in (1, 2):
            wait_until(lambda n=attempt: job_in(client, job_id, "running", n), f"attempt {attempt} runs")
            children = wait_until(solver_children, f"attempt {attempt}'s solver process starts")
            assert len(children) == 1, children
            os.kill(children[0], signal.SIGKILL)  # as the OOM killer would
        failed = wait_until(lambda: job_in(client, job_id, "failed"), "the job fails")
        quick = client.post("/v1/plans", json=plan_body(QUICK_GRAPH, QUICK_BUDGET_BYTES, wait_s=20))
    assert failed["attempts"] == 2 and failed["error"]["type"] == "worker_crashed"
    assert "exit status -9" in failed["error"]["message"], failed["error"]
    assert quick.status_code == 200, "a fresh solver process serves the next job"


REQUESTS = [canonical_json({"request": number}) for number in range(40)]


def test_concurrent_claims_take_each_job_exactly_once(database: str) -> None:
    store = JobStore(database, max_connections=8)
    created = {store.create(request_json=request, budget_bytes=1, solver="dp").id for request in REQUESTS}
    claimed: list[str] = []
    lock = threading.Lock()

    def claim_all(owner: str) -> None:
        while (job := store.claim(owner=owner, lease_s=30, max_attempts=2)) is not None:
            with lock:
                claimed.append(job.id)

    threads = [threading.Thread(target=claim_all, args=(f"runner-{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()
    assert sorted(claimed) == sorted(created), "every job claimed, none twice"


def test_an_expired_lease_passes_the_job_on_and_drops_the_late_answer(database: str) -> None:
    store = JobStore(database)
    job = store.create(request_json=REQUESTS[0], budget_bytes=1, solver="dp")
    first = store.claim(owner="died", lease_s=0.2, max_attempts=2)
    assert store.claim(owner="other", lease_s=0.2, max_attempts=2) is None, "the lease still holds"
    time.sleep(0.3)
    second = store.claim(owner="other", lease_s=0.2, max_attempts=2)
    assert first is not None and second is not None and second.id == job.id and second.attempts == 2
    assert not store.renew(job.id, owner="died", lease_s=30), "the first runner has lost the job"
    assert not store.finish(job.id, '{"late": true}', owner="died")
    time.sleep(0.3)
    assert store.claim(owner="third", lease_s=30, max_attempts=2) is None, "two starts were the limit"
    failed = store.get(job.id)
    store.close()
    assert failed is not None and failed.status is JobStatus.FAILED and failed.result_json is None
    assert failed.error is not None and failed.error.type == "interrupted"


def test_replicas_starting_together_migrate_once(postgres_url: str) -> None:
    import psycopg

    start = threading.Barrier(6)
    errors: list[BaseException] = []

    def open_store() -> None:
        start.wait()
        try:
            JobStore(postgres_url).close()
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=open_store) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with psycopg.connect(postgres_url) as connection:
        versions = connection.execute("SELECT version FROM planner_schema").fetchall()
        columns = connection.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'jobs'"
        ).fetchall()
    assert not errors, errors
    assert versions == [(2,)] and {("owner",), ("lease_expires_at",)} <= set(columns)


@pytest.mark.parametrize("old_name", [True, False])
def test_the_database_setting_takes_a_path_or_a_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, old_name: bool
) -> None:
    monkeypatch.setenv("PLANNER_DB_PATH" if old_name else "PLANNER_DB", "postgresql://u:secret@db/jobs")
    assert Settings().db == "postgresql://u:secret@db/jobs", "a URL is kept as it is, // included"
    assert Settings(db=tmp_path / "x.sqlite3").db == str(tmp_path / "x.sqlite3")
