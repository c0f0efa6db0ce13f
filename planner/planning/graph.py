"""Solving a captured graph into plans without torch: one budget (`plan_graph`) or many (`pareto_frontier`).

This is the path the REST service runs for a posted graph, so nothing here may import torch (a test
checks it). `planner.optimize` captures and profiles a model and then does what `plan_graph` does.

The frontier answers "how much recompute does each byte of budget cost": it solves the same graph at
a list of budgets between the lowest achievable peak and the peak without checkpointing, where every
budget is feasible and the recompute falls from its maximum to zero. A budget below the lowest peak
gets an infeasible point rather than an error, so that one answer covers any list of budgets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.errors import InfeasibleBudget
from planner.ir import ActivationGraph, BudgetKind, MemoryCounting, Schedule, SimulationResult
from planner.planning.plan import Plan
from planner.simulation.allocator import AllocatorSettings
from planner.simulation.step import simulate, store_everything
from planner.solvers import lowest_peak, solve
from planner.solvers.reserved_budget import expandable_note, solve_reserved

__all__ = [
    "Frontier",
    "FrontierPoint",
    "budget_kind_of",
    "frontier_budgets",
    "pareto_frontier",
    "plan_graph",
    "plan_schedule",
]

log = logging.getLogger(__name__)


def plan_graph(
    graph: ActivationGraph,
    *,
    budget_bytes: int,
    solver: str = "auto",
    budget_kind: BudgetKind | str = BudgetKind.ALLOCATED,
    allocator: AllocatorSettings | None = None,
) -> Plan:
    """Solve an already captured graph (torch-free): a Plan without a module. `budget_kind` says what
    the budget bounds (NOTE [budget kinds] in ir.py): "allocated" bytes, or the bytes CUDA's caching
    allocator reserves under `allocator` (PyTorch's default settings unless given)."""
    kind = budget_kind_of(budget_kind, graph)
    solve_started = time.perf_counter()
    allocator_note = ""
    if kind is BudgetKind.RESERVED:
        settings = allocator or AllocatorSettings()
        schedule, min_peak_bytes = solve_reserved(
            graph, budget_bytes=budget_bytes, solver=solver, settings=settings
        )
        allocator_note = expandable_note(
            graph, schedule, budget_bytes=budget_bytes, solver=solver, settings=settings
        )
    else:
        schedule = solve(graph, budget_bytes=budget_bytes, solver=solver)
        min_peak_bytes = lowest_peak(graph)[1].peak_bytes
    solve_ms = (time.perf_counter() - solve_started) * 1e3
    log.info(
        "solved with %s in %.0f ms: %d checkpointed regions", solver, solve_ms, len(schedule.checkpointed)
    )
    return Plan(
        graph=graph,
        schedule=schedule,
        budget_bytes=budget_bytes,
        min_peak_bytes=min_peak_bytes,
        solve_ms=solve_ms,
        budget_kind=kind,
        allocator_note=allocator_note,
    )


def plan_schedule(
    graph: ActivationGraph, schedule: Schedule, *, budget_bytes: int, min_peak_bytes: int
) -> Plan:
    """A schedule made otherwise than by a solver (a hand method's) as a Plan of `graph` at `budget_bytes`,
    without a module; `min_peak_bytes` is the graph's lowest peak (`lowest_peak`, allocated bytes)."""
    return Plan(
        graph=graph,
        schedule=schedule,
        budget_bytes=budget_bytes,
        min_peak_bytes=min_peak_bytes,
        budget_kind=BudgetKind.ALLOCATED,
    )


def budget_kind_of(budget_kind: BudgetKind | str, graph: ActivationGraph) -> BudgetKind:
    """The checked `budget_kind` argument for `graph`: reserved memory is a GPU's, so it needs a graph
    counted in 512-byte blocks, as the caching allocator counts."""
    try:
        kind = BudgetKind(budget_kind)
    except ValueError as error:
        choices = [member.value for member in BudgetKind]
        raise ValueError(
            f"budget_kind={budget_kind!r} is not known; use one of {choices}: 'reserved' bounds what CUDA's "
            "caching allocator reserves (what runs out on a GPU), 'allocated' the live tensors' bytes"
        ) from error
    if kind is BudgetKind.RESERVED and graph.memory_counting is not MemoryCounting.BLOCKS:
        raise ValueError(
            "budget_kind='reserved' bounds CUDA's caching allocator, which counts 512-byte blocks; this "
            f"graph counts {graph.memory_counting.value} bytes: profile with memory_counting='blocks', or "
            "bound budget_kind='allocated'"
        )
    return kind


@dataclass(frozen=True)
class FrontierPoint:
    """The best plan at one budget; `schedule` and `simulation` are None when nothing fits it."""

    budget_bytes: int
    schedule: Schedule | None
    simulation: SimulationResult | None


@dataclass(frozen=True)
class Frontier:
    """Plans over a range of budgets, cheapest budget first, with the two ends of the range."""

    min_peak_bytes: int
    baseline_peak_bytes: int
    points: tuple[FrontierPoint, ...]

    def peaks_and_overheads(self) -> list[tuple[int, float]]:
        """(predicted peak bytes, predicted overhead) of every budget that a plan fits."""
        return [
            (point.simulation.peak_bytes, point.simulation.overhead)
            for point in self.points
            if point.simulation is not None
        ]

    def plot(self, path: str | Path, *, budget_bytes: int | None = None) -> Path:
        """Save the frontier as a picture (.png, .svg, .pdf); needs matplotlib."""
        from planner.report.plots import plot_pareto  # matplotlib only loads when a picture is asked for

        return plot_pareto(self.peaks_and_overheads(), path, budget_bytes=budget_bytes)


def frontier_budgets(min_peak_bytes: int, baseline_peak_bytes: int, *, points: int) -> list[int]:
    """`points` budgets evenly spaced from the lowest peak to the baseline peak, both included."""
    if points < 1:
        raise ValueError(f"points must be at least 1, got {points}")
    if points == 1 or baseline_peak_bytes <= min_peak_bytes:
        return [max(min_peak_bytes, baseline_peak_bytes)]
    span_bytes = baseline_peak_bytes - min_peak_bytes
    return sorted({min_peak_bytes + span_bytes * step // (points - 1) for step in range(points)})


def _frontier_point(graph: ActivationGraph, budget_bytes: int, solver: str) -> FrontierPoint:
    try:
        schedule = solve(graph, budget_bytes=budget_bytes, solver=solver)
    except InfeasibleBudget:
        return FrontierPoint(budget_bytes=budget_bytes, schedule=None, simulation=None)
    return FrontierPoint(budget_bytes=budget_bytes, schedule=schedule, simulation=simulate(graph, schedule))


def pareto_frontier(
    graph: ActivationGraph,
    *,
    budgets_bytes: Sequence[int] | None = None,
    points: int = 8,
    solver: str = "auto",
) -> Frontier:
    """Solve `graph` at each of `budgets_bytes`, or at `points` budgets from lowest peak to baseline."""
    _, lowest = lowest_peak(graph)
    baseline = simulate(graph, store_everything(graph))
    budgets = (
        sorted(set(budgets_bytes))
        if budgets_bytes is not None
        else frontier_budgets(lowest.peak_bytes, baseline.peak_bytes, points=points)
    )
    return Frontier(
        min_peak_bytes=lowest.peak_bytes,
        baseline_peak_bytes=baseline.peak_bytes,
        points=tuple(_frontier_point(graph, budget, solver) for budget in budgets),
    )
