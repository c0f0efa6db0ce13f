"""`SolvedPlan`: a schedule for one graph and budget, with the simulator's predictions that justify it.

Why it exists: a plan is data (the graph, the schedule, the budget, what the simulator predicts of them,
the JSON form `planner.plan/v1`), and it is also shown: summarised, plotted, turned into code to apply by
hand. The report, plots and export read a plan's data, and `planner.Plan` (planner/planning/plan.py)
calls them from its methods; with one class for both, each side imported the other. This is the data
side. The report, plots and export take a SolvedPlan, and `Plan` subclasses it with the methods that show
it or solve it again, so the imports between them point one way (tests/test_layout.py).

Every figure is a prediction of the simulator; nothing here imports torch, so the service and the CLI
load, save and report plans without it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from planner.errors import format_bytes
from planner.ir import GLUE_OP, PLAN_SCHEMA, ActivationGraph, BudgetKind, Node, Schedule, SimulationResult
from planner.serialize import graph_from_dict, graph_to_dict, schedule_from_dict, schedule_to_dict
from planner.simulation.reserved import ReservedPrediction, predict_reserved
from planner.simulation.step import simulate, store_everything

if TYPE_CHECKING:
    import torch

__all__ = ["CompiledStep", "RegionSummary", "SolvedPlan"]


@dataclass(frozen=True)
class RegionSummary:
    """A checkpointed region in the model's own names."""

    first_node: str
    last_node: str
    modules: tuple[str, ...]
    node_count: int


@dataclass(frozen=True)
class CompiledStep:
    """Facts of a plan made for the compiled step (`optimize(..., compile=True)`, compiled/optimize.py)."""

    compile_s: float
    """Seconds `optimize` spent planning and compiling, every attempt included."""
    planning_s: float
    """Of `compile_s`, the seconds spent reading the joint graph and solving it."""
    measured_peak_bytes: int | None
    """The compiled forward and backward on the example inputs, measured in `optimize` (live storages
    on the CPU's allocator, `max_memory_allocated` on a GPU) with the resident state added, or the
    predicted peak after backward (optimizer step) where that is higher. None where not measured."""
    planned_budget_bytes: int
    """The budget the solver was given: the user's, less what an earlier attempt measured above it."""
    attempts: int
    """Compilations made: more than one when a measured peak exceeded the budget and the plan was made
    again under a lower one."""
    graph_breaks: str = ""
    """Why dynamo broke the step's graph, where it did: the plan was then made on the eager step and
    compiled as it is, and only the measured peak describes the compiled step (NOTE [graph breaks] in
    compiled/split_step.py)."""
    eager_draw_calls: tuple[str, ...] = ()
    """Module paths of a split step's calls that fx could not trace and that draw random numbers: the
    plan checkpoints one whole only where nothing else fits, since that checkpoint runs eagerly and
    draws other numbers than the compiled step (NOTE [eager draws] in compiled/split_step.py)."""
    checkpointed_draw_calls: tuple[str, ...] = ()
    """Of `eager_draw_calls`, those the plan checkpoints whole all the same: no plan without them fit
    the budget."""
    hand_method: str = ""
    """The hand method whose schedule the plan is, where no plan of the solvers measured within the
    budget compiled and this one did (NOTE [hand fallback] in compiled/split_step.py)."""


@dataclass
class SolvedPlan:
    """A schedule for one model and budget, with predicted peak and overhead. `planner.Plan` is the one
    `optimize` returns: this plus the profiled step it was solved on and the methods that show it."""

    graph: ActivationGraph
    schedule: Schedule
    budget_bytes: int
    min_peak_bytes: int
    solve_ms: float = 0.0
    module: torch.nn.Module | None = field(default=None, repr=False)
    compiled: CompiledStep | None = None
    """What `optimize(..., compile=True)` found compiling the plan (None for an eager plan)."""
    card: str | None = None
    """The named card whose memory set the budget (`optimize(..., device="h100-80gb")` without a
    budget): its memory less `held_back_bytes`. None for a budget given by hand."""
    held_back_bytes: int = 0
    """Of the card's memory, what the budget leaves out for the CUDA context and cuBLAS workspaces
    (NOTE [held back] in profiler/cost_model.py)."""
    budget_kind: BudgetKind = BudgetKind.ALLOCATED
    """What the budget (and `min_peak_bytes`) bounds: allocated or reserved bytes (NOTE [budget kinds]
    in ir.py). `predicted_peak_bytes` is allocated bytes either way; `reserved` has the reserved ones."""
    allocator_note: str = ""
    """For a reserved budget, what `expandable_segments:True` would change
    (reserved_budget.expandable_note)."""
    simulation: SimulationResult = field(init=False, repr=False)
    baseline: SimulationResult = field(init=False, repr=False)
    _reserved: ReservedPrediction | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.simulation = simulate(self.graph, self.schedule)
        self.baseline = simulate(self.graph, store_everything(self.graph))

    @property
    def predicted_peak_bytes(self) -> int:
        return self.simulation.peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        """Predicted peak without checkpointing, with the same accounting."""
        return self.baseline.peak_bytes

    @property
    def reserved(self) -> ReservedPrediction:
        """The plan's peaks as CUDA's caching allocator would report them, reserved memory included, for
        the default allocator and for expandable segments (predicted; simulation/reserved.py)."""
        if self._reserved is None:
            self._reserved = predict_reserved(self.graph, self.schedule)
        return self._reserved

    @property
    def predicted_overhead(self) -> float:
        """Predicted recompute time over the predicted step time without checkpointing."""
        return self.simulation.overhead

    @property
    def capture(self) -> str:
        return self.graph.capture

    @property
    def solver(self) -> str:
        return self.schedule.solver

    @property
    def regions(self) -> list[RegionSummary]:
        """The checkpointed regions, in execution order."""
        summaries = []
        for region in self.schedule.checkpointed:
            nodes = self.graph.nodes[region.start : region.stop]
            modules = _outermost_paths(nodes)
            summaries.append(
                RegionSummary(
                    first_node=nodes[0].name, last_node=nodes[-1].name, modules=modules, node_count=len(nodes)
                )
            )
        return summaries

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "budget_bytes": self.budget_bytes,
            "min_peak_bytes": self.min_peak_bytes,
            "solve_ms": self.solve_ms,
            "predicted": {
                "peak_bytes": self.predicted_peak_bytes,
                "baseline_peak_bytes": self.baseline_peak_bytes,
                "overhead": self.predicted_overhead,
                "peak_phase": self.simulation.peak_phase.value,
            },
            "schedule": schedule_to_dict(self.schedule),
            "graph": graph_to_dict(self.graph),
            "card": self.card,
            "held_back_bytes": self.held_back_bytes,
            "budget_kind": self.budget_kind.value,
            "allocator_note": self.allocator_note,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The plan a `planner.plan/v1` document describes, as an instance of the class it is called on
        (`planner.Plan.from_dict` gives a Plan), without a module."""
        if data.get("schema") != PLAN_SCHEMA:
            raise ValueError(f"expected a {PLAN_SCHEMA!r} document, got schema={data.get('schema')!r}")
        return cls(
            graph=graph_from_dict(data["graph"]),
            schedule=schedule_from_dict(data["schedule"]),
            budget_bytes=int(data["budget_bytes"]),
            min_peak_bytes=int(data["min_peak_bytes"]),
            solve_ms=float(data.get("solve_ms", 0.0)),
            card=data.get("card"),
            held_back_bytes=int(data.get("held_back_bytes", 0)),
            budget_kind=BudgetKind(data.get("budget_kind", BudgetKind.ALLOCATED.value)),
            allocator_note=str(data.get("allocator_note", "")),
        )

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.from_dict(json.loads(text))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(solver={self.solver!r}, budget={format_bytes(self.budget_bytes)}, "
            f"predicted_peak={format_bytes(self.predicted_peak_bytes)}, "
            f"predicted_overhead={self.predicted_overhead:.1%}, regions={len(self.schedule.checkpointed)})"
        )


def _outermost_paths(nodes: Sequence[Node]) -> tuple[str, ...]:
    """The module paths a region runs, in order, less those inside a call it checkpoints whole (a split
    call's glue is in the region: NOTE [nested units] in profiler/split_calls.py)."""
    whole = {node.module_path for node in nodes if node.op == GLUE_OP and node.module_path}
    paths = dict.fromkeys(node.module_path for node in nodes if node.module_path)
    return tuple(path for path in paths if not any(path.startswith(f"{call}.") for call in whole))
