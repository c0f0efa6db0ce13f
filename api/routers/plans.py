"""`/v1/plans`: post a graph and a budget, get the plan at once or a job to poll.

POST answers 200 with the finished job when the plan is ready within `wait_s` (immediately when an
identical request was solved before), and otherwise 202 with the job and a `Location` to poll.
A job that failed in a way that would repeat (an infeasible budget) is answered with 422 at once.
DELETE cancels a queued or running job: it fails as `cancelled`, and a running solve is killed.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Response

from planner.errors import GraphProblem, InvalidGraph
from planner.ir import BudgetKind, MemoryCounting
from planner.validate import validate_graph

from ..deps import RunnerDep, SettingsDep, StoreDep, require_token
from ..jobs import TERMINAL, Job, JobStatus
from ..schemas import JobView, PlanRequest, job_json
from ..worker import JobFailed, PlanJob
from . import error_responses

__all__ = ["router"]

router = APIRouter(prefix="/v1/plans", tags=["plans"], dependencies=[Depends(require_token)])


def _job_response(job: Job, *, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(job_json(job), status_code=status_code, headers=headers, media_type="application/json")


@router.post(
    "",
    response_model=JobView,
    responses={
        202: {
            "model": JobView,
            "description": "Not solved within wait_s; poll the job at Location",
            "headers": {"Location": {"schema": {"type": "string"}, "description": "The job's URL"}},
        },
        **error_responses(401, 409, 413, 422, 500, 503),
    },
)
async def create_plan(body: PlanRequest, runner: RunnerDep, settings: SettingsDep) -> Response:
    """Solve `graph` for `budget_bytes`: 200 with the plan, or 202 with a job to poll."""
    graph = body.graph.to_graph()
    validate_graph(graph, max_nodes=settings.max_nodes)
    if body.budget_kind is BudgetKind.RESERVED and graph.memory_counting is not MemoryCounting.BLOCKS:
        problem = "budget_kind 'reserved' needs a graph counted in 512-byte blocks (memory_counting 'blocks')"
        raise InvalidGraph([GraphProblem(("memory_counting",), problem)])
    job_request = PlanJob(
        graph=graph,
        budget_bytes=body.budget_bytes,
        solver=body.solver,
        budget_kind=body.budget_kind,
        allocator_conf=body.allocator_conf,
    )
    submission = runner.submit(job_request)
    job = submission.job
    if job.status not in TERMINAL:
        job = await runner.wait(job, timeout_s=min(body.wait_s, settings.max_wait_s))
    if job.status is JobStatus.FAILED:
        assert job.error is not None, f"job {job.id} failed without a recorded error"
        raise JobFailed(job.error)
    if job.status is JobStatus.DONE:
        return _job_response(job)
    return _job_response(
        job, status_code=202, headers={"Location": router.url_path_for("get_plan", job_id=job.id)}
    )


def _unknown_job(job_id: str) -> HTTPException:
    return HTTPException(
        status_code=404,
        detail=f"no job {job_id!r}; jobs are kept in the service's database, "
        "so this id was never issued by it (or the database was replaced)",
    )


@router.get("/{job_id}", response_model=JobView, responses=error_responses(401, 404))
async def get_plan(job_id: str, store: StoreDep) -> Response:
    """The job: its plan once done, its error once failed (failed jobs are answered 200 here)."""
    job = store.get(job_id)
    if job is None:
        raise _unknown_job(job_id)
    return _job_response(job)


@router.delete("/{job_id}", response_model=JobView, responses=error_responses(401, 404, 409))
async def cancel_plan(job_id: str, runner: RunnerDep) -> Response:
    """Cancel a queued or running job: 200 with the job, failed as `cancelled` (again 200 for a job already
    cancelled); 409 for a job that finished otherwise."""
    job = runner.cancel(job_id)
    if job is None:
        raise _unknown_job(job_id)
    if job.error is None or job.error.type != "cancelled":
        raise HTTPException(
            status_code=409,
            detail=f"job {job_id!r} had already finished ({job.status.value}) and cannot be cancelled; "
            "GET it for its plan or error",
        )
    return _job_response(job)
