"""The FastAPI app: settings, lifespan (store, recovery, workers), middleware, routers and offline docs.

`create_app(settings)` builds one app; `planner serve` (planner/cli.py) runs it under uvicorn.

The lifespan opens the job store (an SQLite file or a shared PostgreSQL), re-queues what a previous
process left unfinished (see `JobStore.recover`), starts the workers (and, on PostgreSQL, the sweeper
that takes over jobs of replicas that died), and on shutdown waits briefly for running solves; a solve
cut short stays RUNNING under its lease and is taken again (by another replica once the lease expires,
or at the next start), so no job is silently lost.

The docs at /docs and /redoc use Swagger UI and ReDoc files shipped in the `fastapi-offline` package
and served from this app: no page loads anything from a CDN, so they work on an offline host.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from .errors import install_error_handlers
from .jobs import JobStore
from .limits import BodySizeLimit
from .metrics import ServiceMetrics
from .routers import health, metrics, pareto, plans
from .settings import Settings
from .solve_process import start_forkserver
from .worker import JobRunner, SolveLimits, WorkerPool

__all__ = ["create_app"]

log = logging.getLogger(__name__)

CONNECTIONS_BESIDE_WORKERS = 2
"""PostgreSQL connections beyond one per worker: the event loop's requests and the sweeper."""

DESCRIPTION = """Solves activation-checkpoint plans for graphs captured by the `planner` library.

Post a `planner.graph/v1` document (`planner.serialize.graph_to_dict`, or `PlannerClient`, which
captures and profiles your model locally) with a budget; get a `planner.plan/v1` document back.
The service needs no torch and never unpickles anything.
"""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    store = JobStore(settings.db, max_connections=settings.workers + CONNECTIONS_BESIDE_WORKERS)
    pool = WorkerPool(
        workers=settings.workers, queue_size=settings.queue_size, retry_after_s=settings.retry_after_s
    )
    limits = SolveLimits(
        timeout_s=settings.solve_timeout_s, lease_s=settings.lease_s, max_attempts=settings.max_attempts
    )
    runner = JobRunner(store, pool, limits=limits, observer=app.state.metrics.observe_job)
    app.state.store, app.state.runner = store, runner
    if settings.workers > 0:
        start_forkserver()
    pool.start()
    runner.recover()
    runner.start_sweeping()
    log.info("planner service ready: %d workers, jobs in %s", settings.workers, store.location)
    try:
        yield
    finally:
        runner.stop(grace_s=settings.shutdown_grace_s)
        store.close()


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service app; `settings` default to the PLANNER_* environment variables."""
    app = FastAPIOffline(
        title="planner service",
        version="1",
        description=DESCRIPTION,
        lifespan=lifespan,
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.state.settings = settings or Settings()
    app.state.metrics = ServiceMetrics()
    install_error_handlers(app)
    app.middleware("http")(app.state.metrics.middleware)
    app.add_middleware(BodySizeLimit, max_body_bytes=app.state.settings.max_body_bytes)
    for router in (plans.router, pareto.router, health.router, metrics.router):
        app.include_router(router)
    return app
