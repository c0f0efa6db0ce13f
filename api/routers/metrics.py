"""`/metrics`: the service's Prometheus metrics in the text exposition format (open without a token)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..deps import MetricsDep, PoolDep

__all__ = ["router"]

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}, "description": "Metrics"}
    },
)
async def metrics(metrics: MetricsDep, pool: PoolDep) -> PlainTextResponse:
    """Requests by route and status, request latency, jobs by outcome, solve time, queue depth."""
    metrics.queue_depth.set(pool.queue_depth)
    metrics.workers_busy.set(pool.busy)
    return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
