"""`/v1/pareto`: predicted peak and recompute of the best plan at each of many budgets.

The frontier is computed on the same bounded worker pool as plan jobs (503 when it is full), in a child
process under the same time limit (api/solve_process.py), and the request waits for it: it is not
stored, because it is cheap to ask again and is not needed across a restart. Budgets below the lowest
achievable peak give infeasible points rather than an error.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, HTTPException

from planner.serialize import graph_to_dict
from planner.validate import validate_graph

from ..deps import RunnerDep, SettingsDep, require_token
from ..jobs import canonical_json
from ..schemas import ParetoRequest, ParetoView
from . import error_responses

__all__ = ["router"]

router = APIRouter(prefix="/v1/pareto", tags=["pareto"], dependencies=[Depends(require_token)])


@router.post("", responses=error_responses(401, 413, 422, 500, 503))
async def create_pareto(body: ParetoRequest, runner: RunnerDep, settings: SettingsDep) -> ParetoView:
    """Solve `graph` at `budgets_bytes`, or at `points` budgets from the lowest peak to the baseline."""
    graph = body.graph.to_graph()
    validate_graph(graph, max_nodes=settings.max_nodes)
    pool = runner.pool
    if pool.workers == 0:
        raise HTTPException(
            status_code=503,
            detail="this service runs with PLANNER_WORKERS=0: it stores plan jobs for a later start but "
            "solves nothing now; ask a service that has workers",
            headers={"Retry-After": str(pool.retry_after_s)},
        )
    request_json = canonical_json(
        {
            "graph": graph_to_dict(graph),
            "budgets_bytes": body.budgets_bytes,
            "points": body.points,
            "solver": body.solver,
        }
    )
    frontier = pool.submit(lambda: runner.pareto(request_json))
    view_json: str = await asyncio.wrap_future(frontier)
    return ParetoView.model_validate_json(view_json)
