"""PlannerClient against the app in-process: answers, polling, retries and the service's errors."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import planner.client
from planner.client import PlannerClient
from planner.errors import InfeasibleBudget, ServiceError
from planner.planning.graph import plan_graph
from planner.serialize import schedule_to_dict
from tests.api.service_helpers import middle_budget, small_graph

GRAPH = small_graph()
BUDGET_BYTES = middle_budget(GRAPH)


@pytest.fixture(autouse=True)
def no_sleeping(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(planner.client.time, "sleep", slept.append)
    return slept


def test_plan_graph_matches_solving_locally(client: TestClient) -> None:
    remote = PlannerClient("http://testserver", http=client).plan_graph(
        GRAPH, budget_bytes=BUDGET_BYTES, solver="dp"
    )
    local = plan_graph(GRAPH, budget_bytes=BUDGET_BYTES, solver="dp")
    assert schedule_to_dict(remote.schedule) == schedule_to_dict(local.schedule)
    assert (
        remote.predicted_peak_bytes == local.predicted_peak_bytes
        and remote.min_peak_bytes == local.min_peak_bytes
    )


def test_infeasible_budgets_raise_infeasible_budget_with_the_services_numbers(client: TestClient) -> None:
    with pytest.raises(InfeasibleBudget) as caught:
        PlannerClient("http://testserver", http=client).plan_graph(GRAPH, budget_bytes=2**20, solver="dp")
    assert caught.value.budget_bytes == 2**20 and caught.value.min_peak_bytes > 2**20
    assert "lowest achievable peak" in str(caught.value)


def test_other_errors_carry_the_services_message(client: TestClient) -> None:
    with pytest.raises(
        ServiceError, match="422 to POST /v1/plans: body.solver: Value error, solver 'magic'"
    ) as caught:
        PlannerClient("http://testserver", http=client).plan_graph(GRAPH, budget_bytes=2**30, solver="magic")
    assert caught.value.status_code == 422


def _answers(*responses: httpx.Response | Exception) -> httpx.Client:
    queue = list(responses)

    def handle(request: httpx.Request) -> httpx.Response:
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.Client(transport=httpx.MockTransport(handle))


def _job(status: str, **fields: Any) -> dict[str, Any]:
    return {"id": "j1", "status": status, **fields}


def test_transient_failures_are_retried_with_backoff_and_jobs_are_polled(no_sleeping: list[float]) -> None:
    plan = plan_graph(GRAPH, budget_bytes=BUDGET_BYTES, solver="dp").to_dict()
    http = _answers(
        httpx.ConnectError("refused"),
        httpx.Response(503, headers={"Retry-After": "3"}, json={"detail": []}),
        httpx.Response(202, json=_job("queued")),
        httpx.Response(200, json=_job("running")),
        httpx.Response(200, json=_job("done", plan=plan)),
    )
    client = PlannerClient("http://service", http=http, backoff_s=0.5)
    result = client.plan_graph(GRAPH, budget_bytes=BUDGET_BYTES, solver="dp")
    assert result.schedule == plan_graph(GRAPH, budget_bytes=BUDGET_BYTES, solver="dp").schedule
    assert no_sleeping == [0.5, 3.0, 0.1, 0.2], "backoff 0.5 s, then Retry-After, then polling intervals"


def test_retries_run_out_with_a_clear_error() -> None:
    http = _answers(*[httpx.ConnectError("refused")] * 3)
    with pytest.raises(
        ServiceError, match="cannot reach the planner service at http://service .* after 3 attempts"
    ):
        PlannerClient("http://service", http=http, retries=2).plan_graph(GRAPH, budget_bytes=1)


def test_a_failed_job_raises_with_its_reason() -> None:
    http = _answers(
        httpx.Response(202, json=_job("queued")),
        httpx.Response(200, json=_job("failed", error={"type": "interrupted", "message": "stopped twice"})),
    )
    with pytest.raises(ServiceError, match=r"job j1 failed \(interrupted\): stopped twice"):
        PlannerClient("http://service", http=http).plan_graph(GRAPH, budget_bytes=1)


def test_the_token_is_sent() -> None:
    seen: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        return httpx.Response(
            401, json={"detail": [{"loc": [], "msg": "needs a token", "type": "http_error"}]}
        )

    http = httpx.Client(transport=httpx.MockTransport(handle))
    with pytest.raises(ServiceError, match="401 .*needs a token"):
        PlannerClient("http://service", token="t0k", http=http).plan_graph(GRAPH, budget_bytes=1)
    assert seen == ["Bearer t0k"]


def test_bad_client_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="retries=-1"):
        PlannerClient("http://service", retries=-1)
