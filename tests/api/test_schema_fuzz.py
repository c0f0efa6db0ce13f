"""Fuzz the API from its own OpenAPI document (schemathesis): every answer must match what it declares.

A schema-valid graph is not always a valid graph (its storages must exist, its nodes come in
execution order: rules JSON Schema cannot state), so the check that every schema-valid request is
accepted is left out; the 422 for those is tested in test_plans_api.py. Every other check runs,
server errors and undocumented answers included.

Bounded so that it runs in seconds: a few examples per operation and a short server-side wait. The
operations are driven with hypothesis directly (`as_strategy`) rather than schemathesis' pytest plugin,
which reaches into pytest internals that pytest 9 removed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from pydantic import SecretStr
from schemathesis.checks import positive_data_acceptance

from planner_service.main import create_app
from planner_service.settings import Settings

TOKEN = "fuzz-token"
EXAMPLES_PER_OPERATION = 20
OPERATIONS = [
    ("POST", "/v1/plans"),
    ("GET", "/v1/plans/{job_id}"),
    ("DELETE", "/v1/plans/{job_id}"),
    ("POST", "/v1/pareto"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def service_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    database = Path(tmp_path_factory.mktemp("fuzz")) / "jobs.sqlite3"
    app = create_app(Settings(db=database, token=SecretStr(TOKEN), max_wait_s=0.5, workers=1))
    with TestClient(app):  # runs the lifespan: store and workers stay up while the module's tests run
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


def test_every_operation_is_fuzzed(service_schema: schemathesis.BaseSchema) -> None:
    documented = {
        (method.upper(), path) for path, item in service_schema.raw_schema["paths"].items() for method in item
    }
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_operation_answers_as_documented(
    service_schema: schemathesis.BaseSchema, method: str, path: str
) -> None:
    operation = service_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def answers_as_documented(case: schemathesis.Case) -> None:
        case.call_and_validate(
            headers={"Authorization": f"Bearer {TOKEN}"}, excluded_checks=[positive_data_acceptance]
        )

    answers_as_documented()
