"""Prometheus metrics of one app: requests by route and status, latency, jobs by outcome, queue depth.

Each app gets its own `CollectorRegistry`, so that tests can build many apps in one process without
the duplicate-metric errors of the global registry. Requests are labelled by route *template*
(`/v1/plans/{job_id}`), never by raw path, so that the number of series stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.requests import Request
from starlette.responses import Response

from .jobs import Job, JobStatus

__all__ = ["ServiceMetrics", "job_outcome"]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SOLVE_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


def job_outcome(job: Job) -> str:
    """A finished job's outcome label: `done`, or the failure's type."""
    if job.status is JobStatus.DONE or job.error is None:
        return job.status.value
    return job.error.type


class ServiceMetrics:
    """The service's metrics in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "planner_http_requests",
            "HTTP requests answered",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "planner_http_request_seconds",
            "Time to answer an HTTP request",
            ["route"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.jobs = Counter("planner_jobs", "Jobs finished, by outcome", ["outcome"], registry=self.registry)
        self.solve_seconds = Histogram(
            "planner_solve_seconds", "Time to solve one job", buckets=SOLVE_BUCKETS_S, registry=self.registry
        )
        self.queue_depth = Gauge("planner_queue_depth", "Jobs waiting for a worker", registry=self.registry)
        self.workers_busy = Gauge("planner_workers_busy", "Workers solving a job", registry=self.registry)

    def observe_job(self, job: Job, seconds: float) -> None:
        self.jobs.labels(outcome=job_outcome(job)).inc()
        self.solve_seconds.observe(seconds)

    async def middleware(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = _route_template(request)
        self.requests.labels(method=request.method, route=route, status=str(response.status_code)).inc()
        self.latency.labels(route=route).observe(time.perf_counter() - started)
        return response


def _route_template(request: Request) -> str:
    """The matched route's path template (the router records it in the scope), or "unmatched"."""
    return str(getattr(request.scope.get("route"), "path", "unmatched"))
