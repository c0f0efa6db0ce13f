"""`/v1/pareto`: predicted peak and recompute of the best plan at each of many budgets.

The frontier is computed on the same bounded worker pool as plan jobs (503 when it is full), and the
request waits for it: it is not stored, because it is cheap to ask again and is not needed across a
restart. Budgets below the lowest achievable peak give infeasible points rather than an error.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, HTTPException

from api.deps import PoolDep, SettingsDep, require_token
from api.jobs import JobError
from api.routers import error_responses
from api.schemas import ParetoRequest, ParetoView
from api.worker import JobFailed
from planner.errors import PlannerError
from planner.solving import pareto_frontier
from planner.validate import validate_graph

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/pareto", tags=["pareto"], dependencies=[Depends(require_token)])


@router.post("", responses=error_responses(401, 413, 422, 500, 503))
async def create_pareto(body: ParetoRequest, pool: PoolDep, settings: SettingsDep) -> ParetoView:
    """Solve `graph` at `budgets_bytes`, or at `points` budgets from the lowest peak to the baseline."""
    graph = body.graph.to_graph()
    validate_graph(graph, max_nodes=settings.max_nodes)
    if pool.workers == 0:
        raise HTTPException(
            status_code=503,
            detail="this service runs with PLANNER_WORKERS=0: it stores plan jobs for a later start but "
            "solves nothing now; ask a service that has workers",
            headers={"Retry-After": str(pool.retry_after_s)},
        )
    frontier = pool.submit(
        lambda: pareto_frontier(
            graph, budgets_bytes=body.budgets_bytes, points=body.points, solver=body.solver
        )
    )
    try:
        return ParetoView.of(await asyncio.wrap_future(frontier))
    except PlannerError:
        raise
    except Exception as error:  # noqa: BLE001 - a solver bug is answered like a failed job: 500, named
        log.exception("the frontier failed unexpectedly")
        raise JobFailed(JobError.from_exception(error)) from error
