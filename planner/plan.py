"""`Plan`: what `optimize` returns, the checkpointed module plus the predictions that justify it.

Every figure a Plan reports is a prediction of the simulator, labelled as such; `planner.measure`
gives the measured counterpart. A Plan round-trips through JSON (`planner.plan/v1`) without torch;
a plan loaded from JSON has no module (`planner.profile(model, ...).apply(plan)` gives it one, for a
plan solved on that profile's graph).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import format_bytes
from planner.export import hf_kwargs, torch_snippet
from planner.ir import PLAN_SCHEMA, ActivationGraph, BudgetKind, Schedule, SimulationResult
from planner.report import render_summary
from planner.reserved import ReservedPrediction, memory_snapshot, predict_reserved, write_snapshot
from planner.serialize import graph_from_dict, graph_to_dict, schedule_from_dict, schedule_to_dict
from planner.simulation.step import simulate, store_everything

if TYPE_CHECKING:
    import torch

    from planner.plots import MeasuredSeries
    from planner.profiling import Profile

__all__ = ["CompiledStep", "Plan", "RegionSummary"]


@dataclass(frozen=True)
class RegionSummary:
    """A checkpointed region in the model's own names."""

    first_node: str
    last_node: str
    modules: tuple[str, ...]
    node_count: int


@dataclass(frozen=True)
class CompiledStep:
    """Facts of a plan made for the compiled step (`optimize(..., compile=True)`, compiled.py)."""

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
    compiled_split.py)."""
    eager_draw_calls: tuple[str, ...] = ()
    """Module paths of a split step's calls that fx could not trace and that draw random numbers: the
    plan checkpoints one whole only where nothing else fits, since that checkpoint runs eagerly and
    draws other numbers than the compiled step (NOTE [eager draws] in compiled_split.py)."""
    checkpointed_draw_calls: tuple[str, ...] = ()
    """Of `eager_draw_calls`, those the plan checkpoints whole all the same: no plan without them fit
    the budget."""


@dataclass
class Plan:
    """A schedule for one model and budget, with predicted peak and overhead."""

    graph: ActivationGraph
    schedule: Schedule
    budget_bytes: int
    min_peak_bytes: int
    solve_ms: float = 0.0
    module: torch.nn.Module | None = field(default=None, repr=False)
    profile: Profile | None = field(default=None, repr=False, compare=False)
    """The profiled training step this plan was solved on (set by `optimize` and `Profile.plan`; None
    for a plan loaded from JSON). `replan` solves it again."""
    compiled: CompiledStep | None = None
    """What `optimize(..., compile=True)` found compiling the plan (None for an eager plan)."""
    card: str | None = None
    """The named card whose memory set the budget (`optimize(..., device="h100-80gb")` without a
    budget): its memory less `held_back_bytes`. None for a budget given by hand."""
    held_back_bytes: int = 0
    """Of the card's memory, what the budget leaves out for the CUDA context and cuBLAS workspaces
    (NOTE [held back] in cost_model.py)."""
    budget_kind: BudgetKind = BudgetKind.ALLOCATED
    """What the budget (and `min_peak_bytes`) bounds: allocated or reserved bytes (NOTE [budget kinds]
    in ir.py). `predicted_peak_bytes` is allocated bytes either way; `reserved` has the reserved ones."""
    allocator_note: str = ""
    """For a reserved budget, what `expandable_segments:True` would change (reserved.expandable_note)."""
    simulation: SimulationResult = field(init=False, repr=False)
    baseline: SimulationResult = field(init=False, repr=False)
    _reserved: ReservedPrediction | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.simulation = simulate(self.graph, self.schedule)
        self.baseline = simulate(self.graph, store_everything(self.graph))

    def replan(
        self, *, budget_gb: float | None = None, budget_bytes: int | None = None, solver: str = "auto"
    ) -> Plan:
        """The same model at another budget or with another solver, from this plan's captured and
        profiled graph: no new profiling, so both plans' predictions rest on the same node times."""
        if self.profile is None:
            raise ValueError(
                "this plan has no model to rewrite (it was loaded from JSON); call "
                "planner.profile(model, ...).plan(...) or planner.optimize(model, ...) with the new budget "
                "or solver instead"
            )
        return self.profile.plan(budget_gb=budget_gb, budget_bytes=budget_bytes, solver=solver)

    def predicted_peak_bytes_for(self, *inputs: Any, **kwargs: Any) -> int:
        """Predicted peak of the training step when each micro-batch is `model(*inputs, **kwargs)`:
        "what will this batch size or sequence length cost". The model's graph is built at those
        shapes on the meta device (nothing of the model's size is allocated, no step runs) and this
        plan's regions are carried over to it. The budget holds for the example the plan was made
        with and for every smaller call. Raises ValueError for a plan loaded from JSON, and
        `UnsupportedModel` for a model whose forward needs tensor values to run."""
        if self.profile is None:
            raise ValueError(
                "this plan has no model (it was loaded from JSON); predict with the plan planner.optimize "
                "returns, or planner.profile(model, ...).apply(plan)"
            )
        return self.profile.predicted_peak_bytes(self.schedule, inputs, kwargs)

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
        the default allocator and for expandable segments (predicted; reserved.py)."""
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
            modules = tuple(dict.fromkeys(node.module_path for node in nodes if node.module_path))
            summaries.append(
                RegionSummary(
                    first_node=nodes[0].name, last_node=nodes[-1].name, modules=modules, node_count=len(nodes)
                )
            )
        return summaries

    def summary(self) -> str:
        """A plain-text report: budget, predicted peaks and what sets them, breakdown, regions, levers."""
        return render_summary(self)

    def compare(self, eager: Plan) -> str:
        """For a plan made with `compile=True`: where it differs from `eager`, a plan of the same model
        for the eager step, and why (see `compare_plans` in report.py)."""
        from planner.report import compare_plans

        return compare_plans(self, eager)

    def plot_timeline(self, path: str | Path, *, measured: MeasuredSeries | None = None) -> Path:
        """Save a plot of live memory over the step, with and without the plan (see planner/plots.py)."""
        from planner.plots import plot_timeline

        return plot_timeline(self, path, measured=measured)

    def export_memory_snapshot(self, path: str | Path, *, measured: bool = False) -> Path:
        """Write the plan's predicted step as a PyTorch memory snapshot (the pickle
        `torch.cuda.memory._dump_snapshot` writes), for pytorch.org/memory_viz: the allocator model's
        segments and every allocation, named by its storage, node and module (`reserved.memory_snapshot`).
        With `measured=True`, two real training steps of `plan.module` instead (snapshots.py): the real
        snapshot on a GPU, on the CPU the measured allocations through the same allocator model."""
        if not measured:
            return write_snapshot(memory_snapshot(self.graph, self.schedule), path)
        if self.profile is None or self.module is None:
            raise ValueError(
                "a measured snapshot runs plan.module, and this plan has none (it was loaded from JSON); "
                "export the predicted one, or the one of the plan planner.optimize returns"
            )
        from planner.snapshots import measured_snapshot

        profiled, settings = self.profile, self.profile.settings
        snapshot = measured_snapshot(
            self.module,
            profiled.example_args,
            profiled.example_kwargs,
            loss_fn=settings.loss_fn,
            optimizer=settings.optimizer,
            step=settings.step,
        )
        return write_snapshot(snapshot, path)

    def to_hf_kwargs(self) -> dict[str, Any]:
        """What to pass to a Hugging Face model's `gradient_checkpointing_enable`, when that equals the plan.

        Raises ValueError saying what the plan checkpoints instead when it is not one region per block.
        """
        return hf_kwargs(self)

    def to_torch_snippet(self) -> str:
        """Plain `torch.utils.checkpoint` code equivalent to the plan, to apply it by hand."""
        return torch_snippet(self)

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
    def from_dict(cls, data: dict[str, Any]) -> Plan:
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
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def __repr__(self) -> str:
        return (
            f"Plan(solver={self.solver!r}, budget={format_bytes(self.budget_bytes)}, "
            f"predicted_peak={format_bytes(self.predicted_peak_bytes)}, "
            f"predicted_overhead={self.predicted_overhead:.1%}, regions={len(self.schedule.checkpointed)})"
        )
