"""The wire format: request and response bodies, as pydantic models (and so in the OpenAPI document).

The graph and the plan are the library's own JSON documents (`planner.graph/v1`, `planner.plan/v1`,
written by `planner.serialize` and `Plan.to_dict`). Nodes and static bytes are validated against the ir
dataclasses themselves (pydantic reads their fields and docstrings), so the service's schema cannot
drift from the library's records. Plan documents allow extra keys: a newer serializer may add fields,
and the service must pass them through to the client rather than drop them.

Families follow the usual pattern: `*Request` comes in, `*View` goes out, `ErrorResponse` is every
error (its `detail` entries name the offending field in `loc`, as FastAPI's validation errors do).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from planner.ir import (
    GRAPH_SCHEMA,
    PLAN_SCHEMA,
    ActivationGraph,
    BudgetKind,
    MemoryCounting,
    Node,
    RegionPolicy,
    StaticBytes,
    TrainingStep,
)
from planner.planning.graph import Frontier
from planner.serialize import schedule_to_dict
from planner.simulation.allocator import AllocatorSettings
from planner.solvers import SOLVERS

from .jobs import Job, JobError, JobStatus

__all__ = [
    "ErrorItem",
    "ErrorResponse",
    "GraphDocument",
    "HealthView",
    "JobErrorView",
    "JobView",
    "job_json",
    "ParetoPointView",
    "ParetoRequest",
    "ParetoView",
    "PlanDocument",
    "PlanRequest",
    "ReadyView",
    "ScheduleDocument",
]

MAX_BUDGET_BYTES = 2**62
"""Budgets are stored as SQLite integers (64-bit); 4 EiB is beyond any device."""
MAX_PARETO_POINTS = 64
"""Each point is one solve; more would hold a worker for long."""


def _known_solver(name: str) -> str:
    if name not in SOLVERS:
        raise ValueError(f"solver {name!r} is not known; use one of {sorted(SOLVERS)}")
    return name


def _allocator_conf(text: str) -> str:
    AllocatorSettings.from_conf(text)  # raises ValueError naming the bad option
    return text


SolverName = Annotated[
    str,
    AfterValidator(_known_solver),
    Field(description="A registered solver.", json_schema_extra={"enum": sorted(SOLVERS)}),
]
BudgetBytes = Annotated[
    int, Field(gt=0, le=MAX_BUDGET_BYTES, description="Memory for the whole step, bytes.")
]


class GraphDocument(BaseModel):
    """An activation graph as `planner.serialize.graph_to_dict` writes it (`planner.graph/v1`)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, populate_by_name=True, title="planner.graph/v1"
    )

    schema_: Literal["planner.graph/v1"] = Field(alias="schema")
    capture: str
    """How the model was captured, e.g. "fx"."""
    optimizer: str
    timing: str = "measured"
    """Where per-node times come from: "measured" or "analytic (<device>)"."""
    selective_op_overhead_ms: float = Field(default=0.0, ge=0.0)
    """Time a selective checkpoint policy adds per operator of a region that keeps nodes."""
    checkpoint_call_ms: float = Field(default=0.0, ge=0.0)
    """Time one checkpointed region adds beyond replaying its forward (checkpoint's own work)."""
    checkpoint_op_ms: float = Field(default=0.0, ge=0.0)
    """Time a checkpointed region adds per operator of its nodes (checkpoint's saved-tensor hooks)."""
    static: StaticBytes
    step: TrainingStep = TrainingStep()
    """The training step the static bytes and nodes describe (accumulation, clipping, GradScaler)."""
    memory_counting: MemoryCounting = MemoryCounting.EXACT
    """How every byte figure counts a storage: "blocks" (512-byte blocks, as CUDA's caching allocator
    counts) or "exact"; documents written before this field counted exact bytes."""
    storage_bytes: dict[str, int]
    """Bytes of each activation storage, by name."""
    nodes: list[Node] = Field(min_length=1)
    """The forward's operations in execution order."""

    def to_graph(self) -> ActivationGraph:
        return ActivationGraph(
            nodes=tuple(self.nodes),
            storage_bytes=dict(self.storage_bytes),
            static=self.static,
            capture=self.capture,
            optimizer=self.optimizer,
            timing=self.timing,
            selective_op_overhead_ms=self.selective_op_overhead_ms,
            checkpoint_call_ms=self.checkpoint_call_ms,
            checkpoint_op_ms=self.checkpoint_op_ms,
            step=self.step,
            memory_counting=self.memory_counting,
        )


assert GRAPH_SCHEMA == "planner.graph/v1" and PLAN_SCHEMA == "planner.plan/v1", "update the Literal types"


class PlanRequest(BaseModel):
    """Plan one graph for one budget."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    graph: GraphDocument
    budget_bytes: BudgetBytes
    solver: SolverName = "auto"
    budget_kind: BudgetKind = BudgetKind.ALLOCATED
    """What the budget bounds: "allocated" bytes, or the bytes CUDA's caching allocator reserves
    ("reserved", predicted by replaying the plan's allocations; needs a graph counted in blocks)."""
    allocator_conf: Annotated[str, AfterValidator(_allocator_conf), Field(max_length=1000)] = ""
    """The caching allocator's settings for a reserved budget, as PYTORCH_CUDA_ALLOC_CONF writes them
    ("expandable_segments:True"); empty for PyTorch's defaults."""
    wait_s: float = Field(default=10.0, ge=0, le=600)
    """How long to wait for the plan before answering 202 (capped by the server's max_wait_s)."""


class ParetoRequest(BaseModel):
    """Plan one graph at many budgets: the given ones, or `points` from the lowest peak to the baseline."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    graph: GraphDocument
    budgets_bytes: list[BudgetBytes] | None = Field(default=None, min_length=1, max_length=MAX_PARETO_POINTS)
    points: int = Field(default=8, ge=1, le=MAX_PARETO_POINTS)
    """Used when budgets_bytes is not given."""
    solver: SolverName = "auto"


class RegionDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    start: int
    stop: int
    policy: RegionPolicy


class ScheduleDocument(BaseModel):
    """Checkpoint regions over the nodes in execution order, as `schedule_to_dict` writes them."""

    model_config = ConfigDict(extra="allow")

    solver: str
    regions: list[RegionDocument]


class PredictedDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    peak_bytes: int
    baseline_peak_bytes: int
    overhead: float
    peak_phase: str


class PlanDocument(BaseModel):
    """A plan as `Plan.to_dict` writes it (`planner.plan/v1`); `Plan.from_dict` reads it back."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, title="planner.plan/v1")

    schema_: Literal["planner.plan/v1"] = Field(alias="schema")
    budget_bytes: int
    min_peak_bytes: int
    solve_ms: float
    predicted: PredictedDocument
    schedule: ScheduleDocument
    graph: GraphDocument


class JobErrorView(BaseModel):
    """Why a job failed; infeasible budgets carry the lowest achievable peak."""

    type: str
    message: str
    budget_bytes: int | None = None
    min_peak_bytes: int | None = None
    breakdown: dict[str, int] | None = None

    @classmethod
    def of(cls, error: JobError) -> JobErrorView:
        return cls(
            type=error.type,
            message=error.message,
            budget_bytes=error.budget_bytes,
            min_peak_bytes=error.min_peak_bytes,
            breakdown=error.breakdown,
        )


def _time(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


class JobView(BaseModel):
    """A plan job: `plan` once `status` is done, `error` once it failed."""

    id: str
    status: JobStatus
    budget_bytes: int
    solver: str
    attempts: int
    created_at: datetime
    updated_at: datetime
    plan: PlanDocument | None = None
    error: JobErrorView | None = None

    @classmethod
    def of(cls, job: Job) -> JobView:
        """The job without its plan; `job_json` adds the stored plan text."""
        return cls(
            id=job.id,
            status=job.status,
            budget_bytes=job.budget_bytes,
            solver=job.solver,
            attempts=job.attempts,
            created_at=_time(job.created_at),
            updated_at=_time(job.updated_at),
            error=JobErrorView.of(job.error) if job.error is not None else None,
        )


def job_json(job: Job) -> str:
    """The JobView of `job` as JSON, with the stored plan document spliced in as it was stored.

    The plan was written by `Plan.to_dict` in this service and is sent as it is: parsing and
    re-validating a large graph on every answer would cost more than the rest of the request.
    """
    head = JobView.of(job).model_dump_json(exclude={"plan"})
    return f'{head[:-1]},"plan":{job.result_json or "null"}}}'


class ParetoPointView(BaseModel):
    """The best plan at one budget; the numbers are None when no plan fits it."""

    budget_bytes: int
    feasible: bool
    peak_bytes: int | None = None
    recompute_ms: float | None = None
    overhead: float | None = None
    """Recompute time over the step time without checkpointing."""
    schedule: ScheduleDocument | None = None


class ParetoView(BaseModel):
    """Predicted peak and recompute over budgets, cheapest budget first."""

    min_peak_bytes: int
    baseline_peak_bytes: int
    points: list[ParetoPointView]

    @classmethod
    def of(cls, frontier: Frontier) -> ParetoView:
        points = []
        for point in frontier.points:
            if point.schedule is None or point.simulation is None:
                points.append(ParetoPointView(budget_bytes=point.budget_bytes, feasible=False))
                continue
            points.append(
                ParetoPointView(
                    budget_bytes=point.budget_bytes,
                    feasible=True,
                    peak_bytes=point.simulation.peak_bytes,
                    recompute_ms=point.simulation.recompute_ms,
                    overhead=point.simulation.overhead,
                    schedule=ScheduleDocument.model_validate(schedule_to_dict(point.schedule)),
                )
            )
        return cls(
            min_peak_bytes=frontier.min_peak_bytes,
            baseline_peak_bytes=frontier.baseline_peak_bytes,
            points=points,
        )


class HealthView(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyView(BaseModel):
    """Ready when the database answers and every worker thread is alive."""

    ready: bool
    queue_depth: int
    queue_size: int
    workers_alive: int
    workers: int
    reasons: list[str]


class ErrorItem(BaseModel):
    loc: list[str | int]
    """Where the problem is: ["body", "graph", "nodes", 3, "reads"]; empty when it is the request."""
    msg: str
    type: str


class ErrorResponse(BaseModel):
    """Every error answer. Infeasible budgets (422) also carry the lowest achievable peak."""

    detail: list[ErrorItem]
    budget_bytes: int | None = None
    min_peak_bytes: int | None = None
    breakdown: dict[str, int] | None = None
