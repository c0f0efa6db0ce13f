"""Our rows of bench/compare.py: the plans made at each peer's measured peak, eager and compiled.

Why it exists: compare.py measures every row alike; what differs for ours is how each is planned. One
reference `optimize` call per model gives the predicted range and the profile every eager plan reuses,
rows that plan the same schedule share one variant (and, compiled, one compilation), and a budget below
the predicted lowest peak is planned at that peak (NOTE [infeasible at the peer's peak]).

NOTE [compiled budgets]: our compiled rows plan the compiled step itself, so a compiled peer's measured
peak P is their budget as it is, in the same currency (the allocator's bytes of the whole step). The
compiled step is read once without compiling (`plan_compiled_step`) and solved at every budget and
solver; rows whose schedules agree share one compilation (`CompiledPlans`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import planner
from bench.compare_measurement import Candidate
from bench.compare_report import SOLVERS, Family, Row, label
from bench.peers import mib
from planner.compiled.optimize import plan_compiled_step
from planner.ir import TrainingStep
from planner.planning.graph import plan_graph
from planner.profiler.measurement import default_loss
from planner.testing.steps import Variant, copied_variant, variant_of
from planner.testing.zoo_real import ExampleCall

log = logging.getLogger("bench.compare")

REFERENCE_BUDGET_BYTES = 2**40
"""A budget every plan fits: its plan reports the predicted lowest and no-checkpointing peaks."""


ERROR_CHARS = 400
"""How much of an error's text a row keeps: a compiler's wrapped error names its cause lines down."""


def error_text(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".replace("|", "/").split())[:ERROR_CHARS]


def optimize_at(call: ExampleCall, budget_bytes: int, solver: str) -> planner.Plan:
    """Our plan at a peer's measured peak, which is allocated bytes (`max_memory_allocated` on a GPU):
    so is the budget, though a GPU's default is reserved memory (NOTE [budget kinds] in planner/ir.py)."""
    return planner.optimize(
        call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget_bytes, solver=solver,
        budget_kind="allocated",
    )  # fmt: skip


def our_row(peer: Row, solver: str) -> Row:
    assert peer.peak_bytes is not None
    return Row(
        method="ours", mode=peer.mode, family=Family.OURS, peer=label(peer), solver=solver,
        budget_bytes=peer.peak_bytes, planned_budget_bytes=peer.peak_bytes,
    )  # fmt: skip


@dataclass(frozen=True)
class PlannedVariant:
    """A plan's facts for its rows, and the variant that runs it."""

    predicted_peak_bytes: int
    checkpointed_regions: int
    infeasible_min_peak_bytes: int | None
    description: str
    variant: Variant


@dataclass(frozen=True)
class PredictedRange:
    """Our predicted lowest peak and no-checkpointing peak, from one reference `optimize` call whose
    profile every plan of the model reuses (`Plan.replan`): measured node times move between
    profiling runs, and one profile keeps dp and ilp comparable."""

    reference: planner.Plan

    @property
    def min_peak_bytes(self) -> int:
        return self.reference.min_peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.reference.baseline_peak_bytes


class OurPlans:
    """Our plans for one mode, made once per (solver, budget) and built once per schedule.

    Budgets at or above the predicted no-checkpointing peak need no `optimize` call: the plan
    checkpoints nothing, so its rows share the baseline's variant and measurements. Budgets below the
    predicted lowest peak are planned at that lowest peak (NOTE [infeasible at the peer's peak]).
    """

    def __init__(self, call: ExampleCall, none: Candidate, predicted: PredictedRange) -> None:
        self.call = call
        self.none = none
        self.predicted = predicted
        self.by_budget: dict[tuple[str, int], PlannedVariant] = {}
        self.by_schedule: dict[Any, Variant] = {(): none.variant}

    def planned(self, solver: str, budget_bytes: int) -> PlannedVariant:
        if budget_bytes >= self.predicted.baseline_peak_bytes:
            return PlannedVariant(
                predicted_peak_bytes=self.predicted.baseline_peak_bytes,
                checkpointed_regions=0,
                infeasible_min_peak_bytes=None,
                description="the budget fits no checkpointing: nothing to checkpoint",
                variant=self.none.variant,
            )
        # NOTE [infeasible at the peer's peak]: the row keeps the peer's budget (and says whether it fits);
        # the plan is made at the lowest budget the planner accepts, whose measured peak may still reach it.
        infeasible_min_peak_bytes = None
        if budget_bytes < self.predicted.min_peak_bytes:
            infeasible_min_peak_bytes = budget_bytes = self.predicted.min_peak_bytes
        key = (solver, budget_bytes)
        if key not in self.by_budget:
            plan = self.predicted.reference.replan(budget_bytes=budget_bytes, solver=solver)
            self.by_budget[key] = PlannedVariant(
                predicted_peak_bytes=plan.predicted_peak_bytes,
                checkpointed_regions=len(plan.regions),
                infeasible_min_peak_bytes=infeasible_min_peak_bytes,
                description=f"{len(plan.regions)} checkpointed regions, capture {plan.capture}",
                variant=self.variant(plan),
            )
        return self.by_budget[key]

    def variant(self, plan: planner.Plan) -> Variant:
        key = plan.schedule.checkpointed
        if key not in self.by_schedule:
            assert plan.module is not None
            model = self.call.model
            self.by_schedule[key] = dataclasses.replace(variant_of(model), module=plan.module)
        return self.by_schedule[key]


class CompiledPlans:
    """Our plans of the compiled step (NOTE [compiled budgets]): the step's graph read once without
    compiling, solved at each (solver, budget), and compiled once per distinct schedule, on a copy of the
    model. Budgets below the predicted lowest peak are planned at it (NOTE [infeasible at the peer's
    peak])."""

    def __init__(self, call: ExampleCall) -> None:
        self.call = call
        self.by_schedule: dict[Any, tuple[planner.Plan, Variant]] = {}

    @functools.cached_property
    def reference(self) -> planner.Plan:
        """The compiled step planned once without compiling (raises for a model it cannot plan)."""
        return plan_compiled_step(
            self.call.model, self.call.args, self.call.kwargs, budget_bytes=REFERENCE_BUDGET_BYTES,
            optimizer="adam", step=TrainingStep(), loss_fn=default_loss, solver="dp", device=None,
        )  # fmt: skip

    def planned(self, solver: str, budget_bytes: int) -> PlannedVariant:
        infeasible_min_peak_bytes = None
        if budget_bytes < self.reference.min_peak_bytes:
            infeasible_min_peak_bytes = budget_bytes = self.reference.min_peak_bytes
        schedule = plan_graph(self.reference.graph, budget_bytes=budget_bytes, solver=solver).schedule
        key = tuple((region.start, region.stop, region.keep) for region in schedule.checkpointed)
        if key not in self.by_schedule:
            copied = copied_variant(variant_of(self.call.model))
            plan = planner.optimize(
                copied.module, self.call.args, example_kwargs=self.call.kwargs, budget_bytes=budget_bytes,
                solver=solver, compile=True,
            )  # fmt: skip
            assert plan.module is not None and plan.compiled is not None
            log.info(
                "  compiled plan at %s MiB (%s): %.1f s, %d compilation(s)",
                mib(budget_bytes), solver, plan.compiled.compile_s, plan.compiled.attempts,
            )  # fmt: skip
            self.by_schedule[key] = (plan, Variant(plan.module, copied.parameters, copied.buffers))
        plan, variant = self.by_schedule[key]
        assert plan.compiled is not None
        return PlannedVariant(
            predicted_peak_bytes=plan.predicted_peak_bytes,
            checkpointed_regions=len(plan.regions),
            infeasible_min_peak_bytes=infeasible_min_peak_bytes,
            description=(
                f"{len(plan.regions)} checkpointed regions, compiled plan, {plan.compiled.attempts} "
                f"compilation(s), {plan.compiled.compile_s:.1f} s"
            ),
            variant=variant,
        )


def our_candidate(plans: OurPlans | CompiledPlans, row: Row) -> Candidate | None:
    """`row` with our plan at its planned budget, or None (and the row says why) when planning fails."""
    assert row.planned_budget_bytes is not None and row.solver is not None
    try:
        planned = plans.planned(row.solver, row.planned_budget_bytes)
    except Exception as error:  # one failed plan must not lose the model's other rows
        log.exception("  %s: planning failed", label(row))
        row.error = error_text(error)
        return None
    row.predicted_peak_bytes, row.checkpointed_regions = (
        planned.predicted_peak_bytes,
        planned.checkpointed_regions,
    )
    row.infeasible_min_peak_bytes, row.description = planned.infeasible_min_peak_bytes, planned.description
    return Candidate(row, planned.variant)


def our_candidates(
    plans: OurPlans | CompiledPlans, peers: Sequence[Candidate]
) -> tuple[list[Candidate], list[Row]]:
    """Our `dp` and `ilp` plans at each measured peer's peak, and the rows whose planning failed."""
    candidates, failed = [], []
    for peer in peers:
        if peer.row.peak_bytes is None:
            continue
        for solver in SOLVERS:
            row = our_row(peer.row, solver)
            candidate = our_candidate(plans, row)
            if candidate is None:
                failed.append(row)
            else:
                candidates.append(candidate)
    return candidates, failed
