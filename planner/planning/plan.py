"""`Plan`: what `optimize` returns, the checkpointed module plus the predictions that justify it.

Every figure a Plan reports is a prediction of the simulator, labelled as such; `planner.measure`
gives the measured counterpart. A Plan round-trips through JSON (`planner.plan/v1`) without torch;
a plan loaded from JSON has no module (`planner.profile(model, ...).apply(plan)` gives it one, for a
plan solved on that profile's graph).

The data, the predictions and the JSON form are `SolvedPlan`'s (solvers/solved_plan.py), which the
report, plots and export read. `Plan` adds the profiled step the plan was solved on and the methods that
solve it again or show it by calling those modules, so that they never import this one. The profiled
step is typed by what a plan asks of it (`ProfiledStep`), not as `Profile`, whose module builds plans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from planner.ir import BudgetKind, Schedule, TrainingStep
from planner.report.export import hf_kwargs, torch_snippet
from planner.report.summary import render_summary
from planner.simulation.reserved import memory_snapshot, write_snapshot
from planner.solvers.solved_plan import SolvedPlan

if TYPE_CHECKING:
    import torch

    from planner.profiler.measurement import OptimizerSpec
    from planner.report.plots import MeasuredSeries

__all__ = ["Plan", "ProfiledStep", "StepSettings"]


class StepSettings(Protocol):
    """How the profiled step trains: what a measured snapshot needs to run it again."""

    @property
    def loss_fn(self) -> Callable[[Any], torch.Tensor]: ...

    @property
    def optimizer(self) -> OptimizerSpec: ...

    @property
    def step(self) -> TrainingStep: ...


class ProfiledStep(Protocol):
    """What a plan asks of the profiled training step it was solved on (`planner.Profile` is one): to
    solve it again, to predict its peak at other shapes and to run it."""

    @property
    def example_args(self) -> tuple[Any, ...]: ...

    @property
    def example_kwargs(self) -> Mapping[str, Any]: ...

    @property
    def settings(self) -> StepSettings: ...

    def plan(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        solver: str = "auto",
        budget_kind: BudgetKind | str | None = None,
    ) -> Plan: ...

    def predicted_peak_bytes(
        self, schedule: Schedule, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> int: ...


@dataclass(repr=False)
class Plan(SolvedPlan):
    """A schedule for one model and budget, with predicted peak and overhead, the profiled step it was
    solved on and the methods that show it."""

    profile: ProfiledStep | None = field(default=None, repr=False, compare=False)
    """The profiled training step this plan was solved on (set by `optimize` and `Profile.plan`; None
    for a plan loaded from JSON). `replan` solves it again."""

    def replan(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        solver: str = "auto",
        budget_kind: BudgetKind | str | None = None,
    ) -> Plan:
        """The same model at another budget or with another solver, from this plan's captured and
        profiled graph: no new profiling, so both plans' predictions rest on the same node times. The
        budget bounds what this plan's did (`budget_kind`), unless told otherwise."""
        if self.profile is None:
            raise ValueError(
                "this plan has no model to rewrite (it was loaded from JSON); call "
                "planner.profile(model, ...).plan(...) or planner.optimize(model, ...) with the new budget "
                "or solver instead"
            )
        kind = self.budget_kind if budget_kind is None else budget_kind
        return self.profile.plan(
            budget_gb=budget_gb, budget_bytes=budget_bytes, solver=solver, budget_kind=kind
        )

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

    def summary(self) -> str:
        """A plain-text report: budget, predicted peaks and what sets them, breakdown, regions, levers."""
        return render_summary(self)

    def compare(self, eager: Plan) -> str:
        """For a plan made with `compile=True`: where it differs from `eager`, a plan of the same model
        for the eager step, and why (see `compare_plans` in report/comparison.py)."""
        from planner.report.comparison import compare_plans

        return compare_plans(self, eager)

    def plot_timeline(self, path: str | Path, *, measured: MeasuredSeries | None = None) -> Path:
        """Save a plot of live memory over the step, with and without the plan (see
        planner/report/plots.py)."""
        from planner.report.plots import plot_timeline

        return plot_timeline(self, path, measured=measured)

    def export_memory_snapshot(self, path: str | Path, *, measured: bool = False) -> Path:
        """Write the plan's predicted step as a PyTorch memory snapshot (the pickle
        `torch.cuda.memory._dump_snapshot` writes), for pytorch.org/memory_viz: the allocator model's
        segments and every allocation, named by its storage, node and module (`reserved.memory_snapshot`).
        With `measured=True`, two real training steps of `plan.module` instead (profiler/snapshots.py):
        the real snapshot on a GPU, on the CPU the measured allocations through the same allocator
        model."""
        if not measured:
            return write_snapshot(memory_snapshot(self.graph, self.schedule), path)
        if self.profile is None or self.module is None:
            raise ValueError(
                "a measured snapshot runs plan.module, and this plan has none (it was loaded from JSON); "
                "export the predicted one, or the one of the plan planner.optimize returns"
            )
        from planner.profiler.snapshots import measured_snapshot

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
