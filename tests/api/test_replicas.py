"""Two real `planner serve` replicas (uvicorn subprocesses on 127.0.0.1) sharing one PostgreSQL database.

The lease is 2 s where a replica dies (PLANNER_LEASE_S), so that its death is noticed in seconds; the
slow solve is `ilp` on a 41-node graph (about 9 s of CP-SAT search on the project's 2-core machine).
Where no replica dies the lease is the default's order of magnitude: a replica starved of CPU for 2 s by
a loaded machine would rightly lose its job to the other, which is not what those tests are about.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.api.service_helpers import (
    free_port,
    middle_budget,
    plan_body,
    running_server,
    slow_body,
    small_graph,
    solver_children,
    wait_until,
)

LEASE_S = "2"
UNDISTURBED_LEASE_S = "20"
JOB_TIMEOUT_S = 90.0
DISTINCT_POSTS = 50


@contextmanager
def two_replicas(
    database_url: str, *, lease_s: str = LEASE_S
) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """(url, process) of two replicas with one worker each, on one database."""
    with ExitStack() as stack:
        replicas = []
        for _ in range(2):
            port = free_port()
            process = stack.enter_context(
                running_server(database_url, port=port, workers=1, settings={"PLANNER_LEASE_S": lease_s})
            )
            replicas.append((f"http://127.0.0.1:{port}", process))
        yield replicas


def _row(database_url: str, job_id: str) -> tuple[str, str | None, int]:
    """(status, owner, attempts) of a job as the database holds it."""
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            "SELECT status, owner, attempts FROM jobs WHERE id = %s", (job_id,)
        ).fetchone()
    assert row is not None, f"job {job_id} is not in the database"
    return row[0], row[1], row[2]


def _owner_pid(owner: str) -> int:
    """The pid inside a runner's name (host:pid:nonce, see planner_service.worker.runner_identity)."""
    return int(owner.split(":")[1])


def _running(pid: int) -> bool:
    """True while the process exists and has not exited (a zombie awaiting its reaper has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _get(url: str, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = httpx.get(f"{url}/v1/plans/{job_id}", timeout=10).json()
    return job


def test_a_replica_killed_mid_solve_loses_its_job_to_the_other(postgres_url: str) -> None:
    with two_replicas(postgres_url) as replicas:
        first_url = replicas[0][0]
        job_id = httpx.post(f"{first_url}/v1/plans", json=slow_body(wait_s=0), timeout=30).json()["id"]
        _, owner, _ = wait_until(
            lambda: (row := _row(postgres_url, job_id))[0] == "running" and row, "a replica claims the job"
        )
        holder_pid = _owner_pid(str(owner))
        (holder,) = [process for _, process in replicas if process.pid == holder_pid]
        (survivor_url, survivor) = next((url, process) for url, process in replicas if process is not holder)
        orphans = wait_until(lambda: solver_children(holder.pid), "the holder's solver process starts")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        wait_until(
            lambda: not any(_running(pid) for pid in orphans),
            "the dead replica's solver process exits too (it would hold a core for nothing)",
            timeout_s=5,
        )
        job = wait_until(
            lambda: (job := _get(survivor_url, job_id))["status"] in ("done", "failed") and job,
            "the surviving replica finishes the job",
            timeout_s=JOB_TIMEOUT_S,
        )
        _, final_owner, attempts = _row(postgres_url, job_id)
    assert job["status"] == "done" and job["plan"]["budget_bytes"] == job["budget_bytes"], job.get("error")
    assert attempts == 2 and _owner_pid(str(final_owner)) == survivor.pid, (attempts, final_owner)


def test_a_job_running_on_one_replica_is_cancelled_through_the_other(postgres_url: str) -> None:
    with two_replicas(postgres_url) as replicas:
        job_id = httpx.post(f"{replicas[0][0]}/v1/plans", json=slow_body(wait_s=0), timeout=30).json()["id"]
        _, owner, _ = wait_until(
            lambda: (row := _row(postgres_url, job_id))[0] == "running" and row, "a replica claims the job"
        )
        (other_url,) = [url for url, process in replicas if process.pid != _owner_pid(str(owner))]
        cancelled = httpx.delete(f"{other_url}/v1/plans/{job_id}", timeout=10)
        quick = small_graph(seed=7)
        # both workers must be free within a renewal (1 s at most): two quick jobs, one per replica
        answers = [
            httpx.post(f"{url}/v1/plans", json=plan_body(quick, middle_budget(quick, fraction), wait_s=10))
            for (url, _), fraction in zip(replicas, (0.3, 0.7), strict=True)
        ]
    assert cancelled.status_code == 200 and cancelled.json()["error"]["type"] == "cancelled", cancelled.text
    assert [answer.status_code for answer in answers] == [200, 200], [answer.text for answer in answers]


def test_fifty_distinct_posts_across_two_replicas_are_each_solved_exactly_once(postgres_url: str) -> None:
    graphs = [small_graph(node_count=21 + 5 * (number % 5), seed=number) for number in range(DISTINCT_POSTS)]
    bodies = [plan_body(graph, middle_budget(graph), wait_s=30) for graph in graphs]
    with two_replicas(postgres_url, lease_s=UNDISTURBED_LEASE_S) as replicas:
        urls = [url for url, _ in replicas]

        def post(number: int) -> httpx.Response:
            return httpx.post(f"{urls[number % 2]}/v1/plans", json=bodies[number], timeout=60)

        with ThreadPoolExecutor(max_workers=10) as posters:
            answers = list(posters.map(post, range(DISTINCT_POSTS)))
        pids = {process.pid for _, process in replicas}
    assert [answer.status_code for answer in answers] == [200] * DISTINCT_POSTS, [
        answer.text[:200] for answer in answers if answer.status_code != 200
    ]
    with psycopg.connect(postgres_url) as connection:
        rows = connection.execute("SELECT status, attempts, owner FROM jobs").fetchall()
    assert len(rows) == DISTINCT_POSTS, "distinct graphs are distinct jobs"
    assert {(status, attempts) for status, attempts, _ in rows} == {("done", 1)}, "each solved once"
    solved_by = {_owner_pid(owner) for _, _, owner in rows}
    assert solved_by == pids, f"both replicas solve from the shared queue: {solved_by} of {pids}"
