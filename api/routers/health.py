"""`/healthz` (the process answers) and `/readyz` (the database answers and every worker is alive).

Both are open without a token, for container health checks and load balancers.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..deps import PoolDep, StoreDep
from ..schemas import HealthView, ReadyView

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> HealthView:
    """200 while the process serves requests."""
    return HealthView()


@router.get("/readyz", responses={503: {"model": ReadyView, "description": "Not ready; `reasons` say why"}})
async def readyz(store: StoreDep, pool: PoolDep, response: Response) -> ReadyView:
    """200 when jobs can be stored and solved; 503 with the reasons otherwise."""
    reasons = []
    if not store.ping():
        reasons.append(f"the job database {store.location} does not answer")
    if pool.alive < pool.workers:
        reasons.append(f"{pool.workers - pool.alive} of {pool.workers} worker threads have stopped")
    if pool.queue_depth >= pool.queue_size:
        reasons.append(f"the queue is full ({pool.queue_depth} jobs waiting)")
    if reasons:
        response.status_code = 503
    return ReadyView(
        ready=not reasons,
        queue_depth=pool.queue_depth,
        queue_size=pool.queue_size,
        workers_alive=pool.alive,
        workers=pool.workers,
        reasons=reasons,
    )
