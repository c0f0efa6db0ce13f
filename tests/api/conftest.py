"""Fixtures: an app on a temporary SQLite file, a TestClient that runs its lifespan, and PostgreSQL.

`postgres_server` starts one real server per test session (tests/api/postgres_server.py); each test that
asks for `postgres_url` gets a database of its own on it. Without the server binaries those tests fail,
saying why and what to install (`make test` installs them first: tools/install-postgres.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from planner_service.main import create_app
from planner_service.settings import Settings
from tests.api.postgres_server import fresh_database, running_postgres, why_unavailable


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(db=tmp_path / "jobs.sqlite3", workers=1, max_wait_s=30.0)


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    reason = why_unavailable()
    if reason is not None:
        pytest.fail(f"the job-store tests need a PostgreSQL server: {reason}")
    with running_postgres() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server: str) -> str:
    """An empty database of this test's own on the session's server."""
    return fresh_database(postgres_server)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store in turn: an SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "jobs.sqlite3")
    return str(request.getfixturevalue("postgres_url"))
