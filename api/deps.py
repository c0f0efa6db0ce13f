"""Dependencies of the routers, as `Annotated` aliases (`SettingsDep`, `StoreDep`, `RunnerDep`, ...).

Each reads what the lifespan put on `app.state`, so a test swaps any of them with
`app.dependency_overrides[get_x] = ...`. `require_token` guards the /v1 routers when PLANNER_TOKEN is
set; the comparison is constant-time.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .jobs import JobStore
from .metrics import ServiceMetrics
from .settings import Settings
from .worker import JobRunner, WorkerPool

__all__ = [
    "MetricsDep",
    "PoolDep",
    "RunnerDep",
    "SettingsDep",
    "StoreDep",
    "get_metrics",
    "get_pool",
    "get_runner",
    "get_settings",
    "get_store",
    "require_token",
]


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


async def get_runner(request: Request) -> JobRunner:
    runner: JobRunner = request.app.state.runner
    return runner


async def get_pool(runner: Annotated[JobRunner, Depends(get_runner)]) -> WorkerPool:
    return runner.pool


async def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[JobStore, Depends(get_store)]
RunnerDep = Annotated[JobRunner, Depends(get_runner)]
PoolDep = Annotated[WorkerPool, Depends(get_pool)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]

_bearer = HTTPBearer(
    auto_error=False, description="Needed when the service runs with PLANNER_TOKEN set: `Bearer <token>`."
)


async def require_token(
    settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """401 unless the request carries the configured bearer token (no check when none is configured)."""
    if settings.token is None:
        return
    expected = settings.token.get_secret_value().encode()
    if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), expected):
        raise HTTPException(
            status_code=401,
            detail="this service needs `Authorization: Bearer <token>` with the token it was started with "
            "(PLANNER_TOKEN); PlannerClient(url, token=...) sends it",
            headers={"WWW-Authenticate": "Bearer"},
        )
