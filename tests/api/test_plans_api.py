"""The HTTP API through TestClient: plans, jobs, errors and limits, pareto, auth, health, metrics, docs."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

from planner.ir import Node
from planner.planning.plan import Plan
from planner.serialize import graph_to_dict
from planner_service.deps import get_runner, get_settings
from planner_service.jobs import JobStore
from planner_service.main import create_app
from planner_service.settings import Settings
from planner_service.worker import JobRunner, WorkerPool
from tests.api.service_helpers import middle_budget, plan_body, small_graph

GRAPH = small_graph()
BUDGET_BYTES = middle_budget(GRAPH)


def _locations(response: Any) -> list[list[str | int]]:
    return [item["loc"] for item in response.json()["detail"]]


def test_a_quick_plan_is_answered_at_once_and_round_trips(client: TestClient) -> None:
    response = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES))
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "done" and job["attempts"] == 1 and job["error"] is None
    plan = Plan.from_dict(job["plan"])
    assert plan.graph == GRAPH, "the plan carries the posted graph unchanged"
    assert plan.predicted_peak_bytes <= BUDGET_BYTES < plan.baseline_peak_bytes
    assert plan.schedule.checkpointed, "a budget below the baseline needs checkpointing"
    assert job["plan"]["schema"] == "planner.plan/v1" and job["plan"]["graph"]["schema"] == "planner.graph/v1"


def test_identical_requests_are_answered_from_the_store(client: TestClient) -> None:
    first = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES)).json()
    again = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES, wait_s=0)).json()
    assert again["id"] == first["id"] and again["status"] == "done" and again["attempts"] == 1
    other = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES + 1)).json()
    assert other["id"] != first["id"], "a different budget is a different question"


def test_a_slow_plan_gets_202_and_a_job_to_poll(client: TestClient) -> None:
    response = client.post("/v1/plans", json=plan_body(small_graph(seed=1), BUDGET_BYTES * 2, wait_s=0))
    assert response.status_code in (200, 202)
    job = response.json()
    if response.status_code == 202:
        location = response.headers["Location"]
        assert location == f"/v1/plans/{response.json()['id']}"
        for _ in range(200):
            job = client.get(location).json()
            if job["status"] == "done":
                break
            time.sleep(0.05)
        assert job["status"] == "done" and job["plan"] is not None


def test_an_infeasible_budget_is_422_with_the_lowest_peak_every_time(client: TestClient) -> None:
    for _ in range(2):
        response = client.post("/v1/plans", json=plan_body(GRAPH, 2**20))
        assert response.status_code == 422
        body = response.json()
        assert body["budget_bytes"] == 2**20 and body["min_peak_bytes"] > 2**20
        assert body["breakdown"]["parameters"] == GRAPH.static.parameter_bytes
        assert _locations(response) == [["body", "budget_bytes"]]
        assert "lowest achievable peak" in body["detail"][0]["msg"]


def test_a_failed_job_is_200_with_its_error_when_polled(client: TestClient) -> None:
    response = client.post("/v1/plans", json=plan_body(GRAPH, 2**20, wait_s=0))
    if response.status_code == 422:  # the worker finished before the request gave up waiting
        assert response.json()["min_peak_bytes"] > 2**20
        return
    assert response.status_code == 202
    job_id = response.json()["id"]
    for _ in range(200):
        job = client.get(f"/v1/plans/{job_id}").json()
        if job["status"] == "failed":
            break
        time.sleep(0.05)
    assert job["error"]["type"] == "infeasible_budget" and job["error"]["min_peak_bytes"] > 2**20


def test_unknown_job_is_404(client: TestClient) -> None:
    response = client.get("/v1/plans/no-such-job")
    assert response.status_code == 404 and "no job 'no-such-job'" in response.json()["detail"][0]["msg"]


def _document(**changes: Any) -> dict[str, Any]:
    document = graph_to_dict(GRAPH)
    document.update(changes)
    return document


@pytest.mark.parametrize(
    ("body", "location"),
    [
        ({"graph": _document()}, ["body", "budget_bytes"]),
        ({"graph": _document(), "budget_bytes": "lots"}, ["body", "budget_bytes"]),
        ({"graph": _document(), "budget_bytes": 0}, ["body", "budget_bytes"]),
        ({"graph": _document(), "budget_bytes": 2**30, "solver": "magic"}, ["body", "solver"]),
        ({"graph": _document(), "budget_bytes": 2**30, "colour": "red"}, ["body", "colour"]),
        ({"graph": _document(schema="planner.graph/v0"), "budget_bytes": 2**30}, ["body", "graph", "schema"]),
        (
            {"graph": _document(static={}), "budget_bytes": 2**30},
            ["body", "graph", "static", "parameter_bytes"],
        ),
    ],
)
def test_schema_errors_are_422_naming_the_field(
    client: TestClient, body: dict[str, Any], location: list[Any]
) -> None:
    response = client.post("/v1/plans", json=body)
    assert response.status_code == 422
    assert location in _locations(response), response.text


def test_a_bad_node_field_is_named_by_its_index(client: TestClient) -> None:
    document = graph_to_dict(GRAPH)
    document["nodes"][3]["forward_ms"] = "fast"
    response = client.post("/v1/plans", json={"graph": document, "budget_bytes": 2**30})
    assert response.status_code == 422 and ["body", "graph", "nodes", 3, "forward_ms"] in _locations(response)


def test_invalid_json_is_422(client: TestClient) -> None:
    response = client.post("/v1/plans", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422


def _with_node(index: int, **changes: Any) -> dict[str, Any]:
    nodes = list(GRAPH.nodes)
    nodes[index] = dataclasses.replace(nodes[index], **changes)
    return graph_to_dict(dataclasses.replace(GRAPH, nodes=tuple(nodes)))


@pytest.mark.parametrize(
    ("document", "location", "words"),
    [
        (_with_node(2, inputs=(GRAPH.nodes[4].name,)), ["body", "graph", "nodes"], "cycle"),
        (_with_node(2, reads=("ghost",)), ["body", "graph", "nodes", 2, "reads"], "dangling"),
        (_with_node(2, reads=(GRAPH.nodes[5].creates[0],)), ["body", "graph", "nodes", 2, "reads"], "cycle"),
        (_with_node(2, forward_ms=-1.0), ["body", "graph", "nodes", 2, "forward_ms"], "-1.0"),
        (
            {**graph_to_dict(GRAPH), "storage_bytes": {**GRAPH.storage_bytes, "b0_op0_out": -5}},
            ["body", "graph", "storage_bytes", "b0_op0_out"],
            "negative",
        ),
    ],
)
def test_invalid_graphs_are_422_saying_which_problem(
    client: TestClient, document: dict[str, Any], location: list[Any], words: str
) -> None:
    response = client.post("/v1/plans", json={"graph": document, "budget_bytes": 2**30})
    assert response.status_code == 422, response.text
    matching = [item for item in response.json()["detail"] if item["loc"][: len(location)] == location]
    assert matching and words in matching[0]["msg"], response.text


def test_too_many_nodes_is_422(app: FastAPI, settings: Settings) -> None:
    app.dependency_overrides[get_settings] = lambda: settings.model_copy(update={"max_nodes": 10})
    with TestClient(app) as client:
        response = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES))
        pareto = client.post("/v1/pareto", json={"graph": graph_to_dict(GRAPH)})
    for answer in (response, pareto):
        assert answer.status_code == 422
        assert "more than the limit of 10" in answer.json()["detail"][0]["msg"]


def test_body_over_the_limit_is_413(tmp_path: Path) -> None:
    app = create_app(Settings(db=tmp_path / "jobs.sqlite3", max_body_bytes=4096))
    with TestClient(app) as client:
        declared = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES))
        chunked = client.post("/v1/plans", content=iter([b"x" * 3000] * 3))
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert "more than the limit of 4096 bytes" in response.json()["detail"][0]["msg"]


def test_a_full_queue_is_503_with_retry_after(app: FastAPI, tmp_path: Path) -> None:
    store = JobStore(tmp_path / "stalled.sqlite3")
    stalled = JobRunner(store, WorkerPool(workers=0, queue_size=1, retry_after_s=7))
    app.dependency_overrides[get_runner] = lambda: stalled
    with TestClient(app) as client:
        first = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES, wait_s=0))
        second = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES + 1, wait_s=0))
        pareto = client.post("/v1/pareto", json={"graph": graph_to_dict(GRAPH)})
        ready = client.get("/readyz")
    assert first.status_code == 202
    assert second.status_code == 503 and second.headers["Retry-After"] == "7"
    assert "queue is full" in second.json()["detail"][0]["msg"]
    assert pareto.status_code == 503 and pareto.headers["Retry-After"] == "7"
    assert "PLANNER_WORKERS=0" in pareto.json()["detail"][0]["msg"], "a frontier is not stored for later"
    assert ready.status_code == 503 and "queue is full" in ready.json()["reasons"][0]
    store.close()


def test_the_token_is_required_when_configured(app: FastAPI, settings: Settings) -> None:
    app.dependency_overrides[get_settings] = lambda: settings.model_copy(
        update={"token": SecretStr("s3cret")}
    )
    with TestClient(app) as client:
        missing = client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES))
        wrong = client.get("/v1/plans/x", headers={"Authorization": "Bearer guess"})
        right = client.post(
            "/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES), headers={"Authorization": "Bearer s3cret"}
        )
        health = client.get("/healthz")
    for response in (missing, wrong):
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert "PLANNER_TOKEN" in response.json()["detail"][0]["msg"]
    assert right.status_code == 200 and health.status_code == 200


def test_pareto_covers_lowest_peak_to_baseline(client: TestClient) -> None:
    response = client.post("/v1/pareto", json={"graph": graph_to_dict(GRAPH), "points": 4, "solver": "dp"})
    assert response.status_code == 200, response.text
    frontier = response.json()
    points = frontier["points"]
    assert [point["budget_bytes"] for point in points][0] == frontier["min_peak_bytes"]
    assert points[-1]["budget_bytes"] == frontier["baseline_peak_bytes"]
    assert all(point["feasible"] and point["peak_bytes"] <= point["budget_bytes"] for point in points)
    recompute = [point["recompute_ms"] for point in points]
    assert recompute == sorted(recompute, reverse=True) and recompute[-1] == 0.0, recompute


def test_pareto_marks_budgets_below_the_lowest_peak_infeasible(client: TestClient) -> None:
    body = {"graph": graph_to_dict(GRAPH), "budgets_bytes": [2**20, BUDGET_BYTES], "solver": "dp"}
    points = client.post("/v1/pareto", json=body).json()["points"]
    assert [(point["budget_bytes"], point["feasible"]) for point in points] == [
        (2**20, False),
        (BUDGET_BYTES, True),
    ]
    assert points[0]["peak_bytes"] is None and points[1]["schedule"]["regions"]


def test_health_readiness_and_metrics(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] and ready.json()["workers_alive"] == 1
    client.post("/v1/plans", json=plan_body(GRAPH, BUDGET_BYTES))
    client.get("/v1/plans/unknown")
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'planner_http_requests_total{method="POST",route="/v1/plans",status="200"} 1.0' in text
    assert 'route="/v1/plans/{job_id}",status="404"' in text, "routes are labelled by template, not raw path"
    assert 'planner_jobs_total{outcome="done"} 1.0' in text and "planner_queue_depth 0.0" in text


def test_docs_work_offline(client: TestClient) -> None:
    for page in ("/docs", "/redoc"):
        html = client.get(page).text
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", html), (
            f"{page} loads something from another host"
        )
        assets = re.findall(r"(?:src|href)=[\"']?(/[^\"'> ]+)", html)
        assert assets, f"{page} references no local assets"
        for asset in assets:
            assert client.get(asset).status_code == 200, asset
    schema = client.get("/openapi.json").json()
    titles = {component.get("title") for component in schema["components"]["schemas"].values()}
    assert {"planner.graph/v1", "planner.plan/v1"} <= titles


def test_the_wire_schema_follows_the_ir_records(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert set(schema["Node"]["properties"]) == {field.name for field in dataclasses.fields(Node)}
