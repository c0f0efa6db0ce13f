"""A real `planner serve` (uvicorn on 127.0.0.1, a subprocess): a zoo model planned through
PlannerClient, and jobs that survive the server being killed in the middle of a solve."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx

import planner
from planner.client import PlannerClient
from planner.testing.steps import assert_same_step, one_step
from planner.testing.synthetic_graphs import residual_graph
from planner.zoo import build_model
from tests.api.service_helpers import free_port, middle_budget, plan_body, running_server

JOB_TIMEOUT_S = 120.0


def test_a_zoo_model_planned_by_the_service_trains_like_the_original(tmp_path: Path) -> None:
    model, inputs = build_model("seed000_mlp")
    reference = planner.optimize(model, inputs, budget_gb=1, solver="dp")
    budget_bytes = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    port = free_port()
    with running_server(tmp_path / "jobs.sqlite3", port=port, token="e2e"):
        with PlannerClient(f"http://127.0.0.1:{port}", token="e2e") as client:
            plan = client.optimize(model, inputs, budget_bytes=budget_bytes, solver="dp")
    assert plan.module is not None and plan.schedule.checkpointed, "a middle budget needs checkpointing"
    assert plan.predicted_peak_bytes <= budget_bytes
    local = planner.plan_graph(plan.graph, budget_bytes=budget_bytes, solver="dp")
    assert local.schedule == plan.schedule, "the service's plan is the one planner.optimize would make"
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs))


def _job(url: str, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = httpx.get(f"{url}/v1/plans/{job_id}", timeout=10).json()
    return job


def _statuses_in(database: Path) -> list[str]:
    """Job states as the database holds them (what the next start recovers from), oldest first."""
    with sqlite3.connect(database) as connection:
        return [row[0] for row in connection.execute("SELECT status FROM jobs ORDER BY created_at")]


def test_jobs_outlive_a_server_killed_mid_solve(tmp_path: Path) -> None:
    graph = residual_graph(node_count=400, nodes_per_block=20)
    budgets = [middle_budget(graph, fraction) for fraction in (0.4, 0.6)]
    database = tmp_path / "jobs.sqlite3"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_server(database, port=port, workers=1) as server:
        job_ids = [
            httpx.post(f"{url}/v1/plans", json=plan_body(graph, budget, wait_s=0), timeout=30).json()["id"]
            for budget in budgets
        ]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while _job(url, job_ids[0])["status"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        server.kill()
        server.wait(timeout=10)
    at_kill = _statuses_in(database)
    assert "running" in at_kill and "queued" in at_kill, f"the kill must land mid-solve: {at_kill}"

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_server(database, port=port, workers=1):
        deadline = time.monotonic() + JOB_TIMEOUT_S
        jobs = [_job(url, job_id) for job_id in job_ids]
        while any(job["status"] not in ("done", "failed") for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.2)
            jobs = [_job(url, job_id) for job_id in job_ids]
    for job, status_at_kill in zip(jobs, at_kill, strict=True):
        assert job["status"] == "done" and job["plan"]["budget_bytes"] == job["budget_bytes"], job["status"]
        expected_attempts = 2 if status_at_kill == "running" else 1
        assert job["attempts"] == expected_attempts, (
            f"a job {status_at_kill} at the kill ran {job['attempts']} times"
        )
