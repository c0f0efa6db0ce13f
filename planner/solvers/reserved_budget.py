"""Solving under a reserved budget: the plan whose predicted reserved memory fits, found by allocated solves.

Why it exists: a GPU runs out of memory when CUDA's caching allocator cannot reserve more, and a reserved
budget (`budget_kind='reserved'`, asked for by name) bounds that. The solvers bound allocated bytes,
which they add up region by region; reserved bytes depend on the whole order of allocations, so they
cannot. This solves a reserved budget as a few allocated ones, each plan's reserved peak predicted by
simulation/reserved.py (NOTE [reserved budgets]). It lives with the solvers because it calls them; the
prediction stays in the simulation stage, which the solved plan and the service use without solving.
"""

from __future__ import annotations

import dataclasses

from planner.errors import InfeasibleBudget, format_bytes
from planner.ir import BLOCK_BYTES, ActivationGraph, Schedule
from planner.simulation.allocator import AllocatorSettings
from planner.simulation.reserved import reserved_peak_bytes
from planner.simulation.step import simulate
from planner.solvers import lowest_peak, solve

__all__ = ["MAX_RESERVED_SOLVES", "expandable_note", "solve_reserved"]


def _reserved_hint(
    graph: ActivationGraph, schedule: Schedule, settings: AllocatorSettings, budget_bytes: int
) -> str:
    """What an infeasible reserved budget's message adds: the allocated peak the reserved one is made
    of, and whether expandable segments would fit it."""
    allocated = format_bytes(simulate(graph, schedule).peak_bytes)
    hint = f"(That is the reserved peak, predicted: the plan allocates {allocated}."
    if settings.expandable_segments:
        return hint + ")"
    expandable = dataclasses.replace(settings, expandable_segments=True)
    expandable_bytes = reserved_peak_bytes(graph, schedule, expandable)
    if expandable_bytes <= budget_bytes:
        return (
            f"{hint} With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it reserves "
            f"{format_bytes(expandable_bytes)} and fits: set it in the training process's environment "
            "and plan with optimize(..., allocator_conf='expandable_segments:True').)"
        )
    return f"{hint} With expandable segments it reserves {format_bytes(expandable_bytes)}.)"


MAX_RESERVED_SOLVES = 8
"""Solves a reserved budget tries (NOTE [reserved budgets])."""


def solve_reserved(
    graph: ActivationGraph, *, budget_bytes: int, solver: str, settings: AllocatorSettings
) -> tuple[Schedule, int]:
    """(The schedule with the least recompute found whose predicted reserved peak fits `budget_bytes`,
    the reserved peak of the plan with the lowest allocated peak.)

    NOTE [reserved budgets]: the solvers bound allocated bytes, which they add up region by region;
    reserved bytes depend on the whole order of allocations. So a reserved budget is solved as an
    allocated one, first at the budget itself, then bisecting the allocated budget between the lowest
    allocated peak and the budget, each plan replayed through the allocator model, at most
    MAX_RESERVED_SOLVES solves; the largest allocated budget whose plan reserves within the budget wins.
    The plan with the lowest allocated peak is the fallback, and the measure of infeasibility: where
    even it reserves more than the budget, `InfeasibleBudget` carries its reserved peak. A plan that
    reserves less may exist; this finds the ones the allocated solves lead to.
    """
    lowest_schedule, lowest = lowest_peak(graph)
    lowest_reserved_bytes = reserved_peak_bytes(graph, lowest_schedule, settings)
    if lowest_reserved_bytes > budget_bytes:
        raise InfeasibleBudget(
            budget_bytes=budget_bytes,
            min_peak_bytes=lowest_reserved_bytes,
            breakdown=lowest.breakdown,
            hint=_reserved_hint(graph, lowest_schedule, settings, budget_bytes),
        )
    best, fitting_bytes, over_bytes = lowest_schedule, lowest.peak_bytes, budget_bytes + 1
    target_bytes = budget_bytes
    for _ in range(MAX_RESERVED_SOLVES):
        if target_bytes < lowest.peak_bytes:
            break
        schedule = solve(graph, budget_bytes=target_bytes, solver=solver)
        if reserved_peak_bytes(graph, schedule, settings) <= budget_bytes:
            best, fitting_bytes = schedule, target_bytes
            if target_bytes == budget_bytes:
                break
        else:
            over_bytes = target_bytes
        target_bytes = (fitting_bytes + over_bytes) // 2
        if over_bytes - fitting_bytes <= BLOCK_BYTES:
            break
    return best, lowest_reserved_bytes


def expandable_note(
    graph: ActivationGraph, schedule: Schedule, *, budget_bytes: int, solver: str, settings: AllocatorSettings
) -> str:
    """What a report says when `expandable_segments:True` changes the answer to a reserved budget: the
    recompute of the plan it would let fit, where that is less than `schedule`'s ("" otherwise)."""
    if settings.expandable_segments:
        return ""
    expandable = dataclasses.replace(settings, expandable_segments=True)
    other, _ = solve_reserved(graph, budget_bytes=budget_bytes, solver=solver, settings=expandable)
    ours, theirs = simulate(graph, schedule), simulate(graph, other)
    if theirs.recompute_ms >= ours.recompute_ms:
        return ""
    return (
        f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True a plan recomputing {theirs.overhead:.1%} of "
        f"the step fits this budget (this one: {ours.overhead:.1%}); plan with allocator_conf="
        "'expandable_segments:True' and set it for training"
    )
