"""Solvers: one signature, one registry, every result checked with the simulator.

    def solve_x(graph: ActivationGraph, *, budget_bytes: int) -> Schedule

A solver returns a schedule whose *simulated* peak is within the budget, or raises `InfeasibleBudget`
carrying the lowest peak any known schedule reaches. Registered solvers:

- `none`: no checkpointing (the baseline every plan is compared with);
- `chen`: sqrt(n) equal segments, all but the last checkpointed (what `checkpoint_sequential` does);
- `dp`: least recompute over regions between candidate boundaries: every module call and every cut,
  with whatever tensors cross them (solvers/chain.py, solvers/dp.py);
- `ilp`: CP-SAT over the same regions plus selective keeps inside checkpointed regions
  (solvers/ilp.py), warm-started from `dp` and never returning a worse plan than `dp`'s (more
  recompute, or as much at a higher peak);
- `auto`: `ilp` with a 1 s deterministic-time budget while the model is small enough, else `dp`.

Stage 4 of planner/'s packages (docs/layout.md): ActivationGraph -> Schedule, with solving under a
reserved budget (`reserved_budget`) and a solved plan's data (`solved_plan`). It may import the contract
(ir, errors, serialize) and planner.simulation, never torch: the service solves posted graphs with it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.errors import InfeasibleBudget
from planner.ir import ActivationGraph, Region, RegionPolicy, Schedule, SimulationResult
from planner.simulation.step import CheckpointRule, simulate, store_everything
from planner.solvers.chain import Chain, build_chain
from planner.solvers.dp import CostTable, least_recompute, min_peak_schedule, region_costs, tabulate
from planner.solvers.ilp import DETERMINISTIC_SECONDS, ilp_schedule
from planner.solvers.region_costs import RegionCosts

log = logging.getLogger(__name__)

__all__ = ["SOLVERS", "Solver", "check_solver", "chen_schedule", "lowest_peak", "solve"]

Solver = Callable[..., Schedule]
ILP_TIME_LIMIT_S = 10.0
AUTO_ILP_DETERMINISTIC_S = 1.0
"""CP-SAT's deterministic-time budget under `auto` (explicit `ilp`: DETERMINISTIC_SECONDS). Where the
dp bound does not prove the plan optimal (many identical layers), CP-SAT's last seconds buy a fraction
of a percent of recompute; `auto` answers in about a second instead."""
AUTO_ILP_MAX_TRANSITIONS = 1500
AUTO_ILP_MAX_NODES = 2000
"""Beyond these `auto` uses `dp`: the ILP has a constraint per point of every transition with keeps."""
MAX_TIGHTENING = 6
"""Times `dp` re-solves with a lower limit when the simulator finds its plan over budget."""
RECOMPUTE_TIE_MS = 1e-9
"""Recompute times closer than this are a tie, which the lower simulated peak breaks."""


@dataclass(frozen=True)
class _Tables:
    graph: ActivationGraph
    chain: Chain
    costs: RegionCosts
    table: CostTable


_cache: list[_Tables] = []


def _tables(graph: ActivationGraph) -> _Tables:
    """Chain, region costs and cost table of `graph`, built once per graph object."""
    for entry in _cache:
        if entry.graph is graph:
            return entry
    chain = build_chain(graph)
    costs = region_costs(chain)
    entry = _Tables(graph=graph, chain=chain, costs=costs, table=tabulate(costs))
    _cache[:] = [entry, *_cache[:3]]
    return entry


def chen_schedule(graph: ActivationGraph) -> Schedule:
    """sqrt(n) segments of about equal node count at candidate boundaries; all but the last checkpointed."""
    inner = _tables(graph).chain.boundaries[1:-1]
    segments = max(1, round(math.sqrt(len(inner) + 1)))
    total = len(graph.nodes)
    chosen = sorted(
        {min(inner, key=lambda c: abs(c - total * i / segments)) for i in range(1, segments)}
        if inner
        else set()
    )
    bounds = [0, *chosen, total]
    regions = []
    rule = CheckpointRule.of(graph)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        last = stop == total
        checkpointable = rule.allows(graph, start, stop)
        policy = RegionPolicy.CHECKPOINT if (not last and checkpointable) else RegionPolicy.STORE
        regions.append(Region(start, stop, policy))
    return Schedule(regions=tuple(regions), solver="chen")


def lowest_peak(graph: ActivationGraph) -> tuple[Schedule, SimulationResult]:
    """The known schedule with the lowest simulated peak (the min-peak DP, chen and no checkpointing)."""
    candidates = [
        min_peak_schedule(_tables(graph).chain, _tables(graph).table),
        chen_schedule(graph),
        store_everything(graph),
    ]
    simulated = [(schedule, simulate(graph, schedule)) for schedule in candidates]
    return min(simulated, key=lambda pair: (pair[1].peak_bytes, pair[1].recompute_ms))


def _infeasible(graph: ActivationGraph, budget_bytes: int) -> InfeasibleBudget:
    _, result = lowest_peak(graph)
    return InfeasibleBudget(
        budget_bytes=budget_bytes, min_peak_bytes=result.peak_bytes, breakdown=result.breakdown
    )


def _fixed(schedule_of: Callable[[ActivationGraph], Schedule]) -> Solver:
    """A solver whose plan space is one schedule: it fits or it raises with that schedule's peak."""

    def solve_fixed(graph: ActivationGraph, *, budget_bytes: int) -> Schedule:
        schedule = schedule_of(graph)
        result = simulate(graph, schedule)
        if result.peak_bytes > budget_bytes:
            raise InfeasibleBudget(
                budget_bytes=budget_bytes, min_peak_bytes=result.peak_bytes, breakdown=result.breakdown
            )
        return schedule

    return solve_fixed


def solve_dp(graph: ActivationGraph, *, budget_bytes: int) -> Schedule:
    """Least predicted recompute with simulated peak <= budget_bytes."""
    tables = _tables(graph)
    limit_bytes = budget_bytes - graph.static.resident_bytes
    for _ in range(MAX_TIGHTENING):
        found = least_recompute(tables.chain, tables.table, activation_budget_bytes=limit_bytes)
        if found is None:
            break
        peak_bytes = simulate(graph, found.schedule).peak_bytes
        if peak_bytes <= budget_bytes:
            # Optimal over the plan space unless a search bound was hit (NOTE [held storages] caps).
            return dataclasses.replace(found.schedule, gap=0.0 if found.exact else float("nan"))
        limit_bytes -= peak_bytes - budget_bytes
    fallback, result = lowest_peak(graph)
    if result.peak_bytes <= budget_bytes:
        return Schedule(regions=fallback.regions, solver="dp")
    raise _infeasible(graph, budget_bytes)


def solve_ilp(
    graph: ActivationGraph, *, budget_bytes: int, deterministic_time_s: float = DETERMINISTIC_SECONDS
) -> Schedule:
    """CP-SAT with selective keeps, warm-started from `dp`; never worse than `dp`'s plan."""
    dp_plan = solve_dp(graph, budget_bytes=budget_bytes)
    dp_result = simulate(graph, dp_plan)
    dp_ms = dp_result.recompute_ms
    started = time.perf_counter()
    result = ilp_schedule(
        _tables(graph).costs,
        _tables(graph).table,
        activation_budget_bytes=budget_bytes - graph.static.resident_bytes,
        hint=dp_plan,
        time_limit_s=ILP_TIME_LIMIT_S,
        deterministic_time_s=deterministic_time_s,
    )
    log.info(
        "ilp solved in %.2f s: %s", time.perf_counter() - started, "no plan" if result is None else result
    )
    if result is not None:
        simulated = simulate(graph, result.schedule)
        if simulated.peak_bytes <= budget_bytes and simulated.recompute_ms <= dp_ms:
            less_recompute = simulated.recompute_ms < dp_ms - RECOMPUTE_TIE_MS
            if less_recompute or simulated.peak_bytes <= dp_result.peak_bytes:
                return dataclasses.replace(result.schedule, gap=result.gap)
            # the same least recompute (often none at all), which dp's plan reaches at a lower peak
            return Schedule(regions=dp_plan.regions, solver="ilp", gap=result.gap)
        log.info(
            "ilp plan (peak %d of %d bytes, %.2f ms recompute) no better than dp's (%.2f ms); keeping dp's",
            simulated.peak_bytes,
            budget_bytes,
            simulated.recompute_ms,
            dp_ms,
        )
    return Schedule(regions=dp_plan.regions, solver="ilp", gap=float("nan"))


def solve_auto(graph: ActivationGraph, *, budget_bytes: int) -> Schedule:
    """`ilp` while its model stays small (transitions), else `dp`."""
    transitions = sum(len(ts) for ts in _tables(graph).table.transitions.values())
    if transitions <= AUTO_ILP_MAX_TRANSITIONS and len(graph.nodes) <= AUTO_ILP_MAX_NODES:
        return solve_ilp(graph, budget_bytes=budget_bytes, deterministic_time_s=AUTO_ILP_DETERMINISTIC_S)
    return solve_dp(graph, budget_bytes=budget_bytes)


SOLVERS: dict[str, Solver] = {
    "none": _fixed(store_everything),
    "chen": _fixed(chen_schedule),
    "dp": solve_dp,
    "ilp": solve_ilp,
    "auto": solve_auto,
}


def check_solver(solver: str) -> str:
    """`solver` when the registry has it, else a ValueError listing the registry (checked before
    profiling, so a typo costs no profiling run)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r} is not known; use one of {sorted(SOLVERS)}")
    return solver


def solve(graph: ActivationGraph, *, budget_bytes: int, solver: str = "auto") -> Schedule:
    """Run the named solver; unknown names get a ValueError listing the registry."""
    return SOLVERS[check_solver(solver)](graph, budget_bytes=budget_bytes)
