"""`ilp`: OR-tools CP-SAT over region boundaries *and* selective keeps inside checkpointed regions.

The plan space is `dp`'s (regions between candidate boundaries, each stored or checkpointed) plus,
inside a checkpointed region, a set of nodes whose outputs are kept instead of replayed (NOTE
[selective keeps] in simulation/step.py). Keeping an expensive matmul and replaying the cheap pointwise ops
around it is how Megatron's selective recompute saves most activation memory for a few percent of
extra compute.

Model (a shortest path with side constraints):

- Path vertices are `dp`'s states (boundary, crossing storages held so far; NOTE [held storages] in
  solvers/chain.py); an edge is a candidate region (a `Transition`).
  `use[e]` selects edges; flow conservation makes the selection a partition of the nodes.
- `keep[k]` per keepable node (see `keepable`); a kept node must lie in a selected checkpointed region
  that allows it (it is replayed: at or before the region's trigger; its outputs stay inside).
- `retained[v]` bounds the bytes earlier regions retain at vertex v; a selected edge adds its charged
  bytes (constraints are enforced only when their edge is selected: no big-M).
- For every selected edge and every moment of its timeline (forward, replay, backward nodes):
  retained[src] + point(keep) <= budget. Each point is affine in `keep`: keeps touch disjoint
  storages, so the coefficients are measured once per node by `region_cost` with that node kept.
- Objective: recompute time of the selected checkpointed regions minus the time of kept nodes.

Bytes are rounded up to `BYTES_UNIT` and the budget down, so every plan the model accepts fits; the
caller still checks the plan with the simulator. The search is warm-started from `dp`'s plan and
limited in deterministic time, so results repeat for a given seed; the proven gap is reported.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.ir import Region, RegionPolicy, Schedule, merge_stored
from planner.simulation.replay import replay_stop, selective_overhead_ms
from planner.simulation.step import recompute_trigger
from planner.solvers.chain import Chain, RegionCost, RegionCostSummary, State, keep_effect
from planner.solvers.dp import CostTable, least_recompute
from planner.solvers.region_costs import RegionCosts

__all__ = ["IlpResult", "ilp_schedule", "keepable"]

BYTES_UNIT = 1024
TIME_UNITS_PER_MS = 1000
MAX_KEEP_CANDIDATES = 32
"""Keepable nodes offered to the model: the most forward time per cached byte first."""
DETERMINISTIC_SECONDS = 5.0
"""CP-SAT's deterministic time limit (about seconds of one core); wall time is capped separately."""
RELATIVE_GAP_LIMIT = 0.005
"""CP-SAT stops once its plan is proven within 0.5 % of optimal (the reported gap is exact)."""


@dataclass(frozen=True)
class IlpResult:
    schedule: Schedule
    recompute_ms: float
    gap: float
    """(objective - proven bound) / objective, in [0, 1]; 0 when proven optimal."""
    optimal: bool


@dataclass(frozen=True)
class _Edge:
    source: State
    target: State
    region: Region
    cost: RegionCost
    keep_points: dict[int, tuple[int, ...]]
    """Per allowed keep node: the change of each point when it is kept."""
    keep_charged: dict[int, int]
    selective_ms: float
    """The selective policy's overhead, paid once any node of the region is kept."""


def _load_cp_model() -> Any:
    try:
        return importlib.import_module("ortools.sat.python.cp_model")
    except ImportError as error:
        raise ImportError("the ilp solver needs OR-tools: pip install 'ortools>=9.10'") from error


def keepable(chain: Chain) -> list[int]:
    """Nodes a selective policy may keep: deterministic, allocating, the best time per byte first."""
    candidates = [
        index
        for index, node in enumerate(chain.graph.nodes)
        if node.checkpointable
        and not node.part_of  # a split call's parts run as Python code: nothing to mark (NOTE [split calls])
        and node.keep_cache_bytes > 0
        and node.forward_ms > 0
        and not (node.random or node.stateful or node.in_place)
    ]
    candidates.sort(
        key=lambda i: chain.graph.nodes[i].forward_ms / chain.graph.nodes[i].keep_cache_bytes, reverse=True
    )
    return sorted(candidates[:MAX_KEEP_CANDIDATES])


def _allowed_keeps(chain: Chain, region: Region, candidates: list[int]) -> list[int]:
    trigger = recompute_trigger(chain.graph, region)
    if trigger is None:
        return []
    return [
        index
        for index in candidates
        if region.start <= index < replay_stop(chain.graph, trigger)
        and all(chain.last_use.get(name, index) < region.stop for name in chain.graph.nodes[index].creates)
    ]


def _units(size_bytes: float) -> int:
    return math.ceil(size_bytes / BYTES_UNIT)


def _edges(costs: RegionCosts, candidates: list[int], table: CostTable) -> list[_Edge]:
    """One edge per transition of `dp`'s table.

    A region without allowed keeps needs only its peak, which the table has; one with keeps needs every
    point of its timeline and each keep's effect on them.
    """
    chain = costs.chain
    edges = []
    effects: dict[tuple[int, int], tuple[dict[int, tuple[int, ...]], dict[int, int]]] = {}
    for transitions in table.transitions.values():
        for transition in transitions:
            region = transition.region
            start, stop = region.start, region.stop
            summary = transition.variants[0]
            checkpointed = region.policy is RegionPolicy.CHECKPOINT
            keeps = _allowed_keeps(chain, region, candidates) if checkpointed else []
            if keeps:
                cost = costs.cost(region, held_in=transition.source[1])
                if (start, stop) not in effects:
                    effect = {index: keep_effect(chain, region, index) for index in keeps}
                    effects[(start, stop)] = (
                        {index: points for index, (points, _) in effect.items()},
                        {index: charged for index, (_, charged) in effect.items()},
                    )
                keep_points, keep_charged = effects[(start, stop)]
            else:
                cost = RegionCost(summary.charged_bytes, (summary.peak_bytes,), summary.recompute_ms)
                keep_points, keep_charged = {}, {}
            edges.append(
                _Edge(
                    source=transition.source,
                    target=transition.target,
                    region=region,
                    cost=cost,
                    keep_points=keep_points,
                    keep_charged=keep_charged,
                    selective_ms=selective_overhead_ms(
                        chain.graph, Region(start, stop, region.policy, tuple(keeps))
                    ),
                )
            )
    return edges


def _keep_order(chain: Chain, edge: _Edge) -> list[int]:
    """The region's allowed keeps, the most forward time per charged byte first."""
    nodes = chain.graph.nodes
    return sorted(edge.keep_points, key=lambda k: (-nodes[k].forward_ms / max(1, edge.keep_charged[k]), k))


def _variants(chain: Chain, edge: _Edge, *, relaxed: bool) -> tuple[RegionCostSummary, ...]:
    """The region without keeps, then one variant per number m of keeps.

    Exact (`relaxed=False`): the first m allowed keeps in `_keep_order`, costed exactly (each point is
    affine in the keeps): plans built from these are feasible, a warm start for CP-SAT.
    Relaxed: for any m keeps, each term at its most favourable over every m-subset (the m smallest
    charged bytes, at each point the m smallest changes, the m longest forward times). No m-subset
    does better in any term, so the least recompute over relaxed variants bounds the ilp's optimum.
    """
    base = np.array(edge.cost.points_bytes, dtype=np.int64)
    variants = [RegionCostSummary(int(base.max()), edge.cost.charged_bytes, edge.cost.recompute_ms)]
    if not edge.keep_points:
        return tuple(variants)
    keeping_ms = edge.cost.recompute_ms + edge.selective_ms
    nodes = chain.graph.nodes
    order = _keep_order(chain, edge)
    deltas = np.array([edge.keep_points[k] for k in order], dtype=np.int64)
    charged = np.array([edge.keep_charged[k] for k in order], dtype=np.int64)
    saved_ms = np.array([nodes[k].forward_ms for k in order])
    if relaxed:
        deltas, charged, saved_ms = np.sort(deltas, axis=0), np.sort(charged), -np.sort(-saved_ms)
    points, charged_sums, saved_sums = (
        np.cumsum(deltas, axis=0) + base,
        np.cumsum(charged),
        np.cumsum(saved_ms),
    )
    for m in range(len(order)):
        variants.append(
            RegionCostSummary(
                peak_bytes=int(points[m].max()),
                charged_bytes=edge.cost.charged_bytes + int(charged_sums[m]),
                recompute_ms=max(0.0, keeping_ms - float(saved_sums[m])),
                keep=() if relaxed else tuple(sorted(order[: m + 1])),
            )
        )
    return tuple(variants)


def _variant_table(chain: Chain, table: CostTable, edges: list[_Edge], *, relaxed: bool) -> CostTable:
    return table.with_variants(
        {(edge.source, edge.region): _variants(chain, edge, relaxed=relaxed) for edge in edges}
    )


def _relevant_points(edge: _Edge) -> list[int]:
    """Points that can be the region's maximum for some keep set (the others never bind)."""
    base = edge.cost.points_bytes
    floor = max(base)
    relevant = []
    for j, value in enumerate(base):
        upper = value + sum(max(0, delta[j]) for delta in edge.keep_points.values())
        if upper >= floor:
            relevant.append(j)
    return relevant


def ilp_schedule(
    costs: RegionCosts,
    table: CostTable,
    *,
    activation_budget_bytes: float,
    hint: Schedule | None,
    time_limit_s: float,
    deterministic_time_s: float = DETERMINISTIC_SECONDS,
    seed: int = 0,
) -> IlpResult | None:
    """Least-recompute schedule with keeps over `table`'s regions; None when no plan fits.

    Before CP-SAT, `dp` runs twice over keep variants of each region (`_variants`): over exact ones
    for a plan with keeps (the warm start, better than `hint` when keeps pay), and over relaxed ones
    for a lower bound. When the plan meets the bound it is optimal and CP-SAT is not run (every graph
    without keepable nodes, for one); otherwise the bound tightens CP-SAT's reported gap.
    """
    budget_units = math.floor(activation_budget_bytes / BYTES_UNIT)
    if budget_units < 0:
        return None
    chain = costs.chain
    candidates = keepable(chain)
    edges = _edges(costs, candidates, table)
    relaxed = least_recompute(
        chain,
        _variant_table(chain, table, edges, relaxed=True),
        activation_budget_bytes=activation_budget_bytes,
    )
    if relaxed is None:
        return None
    bound_ms = relaxed.recompute_ms if relaxed.exact else 0.0
    greedy = least_recompute(
        chain,
        _variant_table(chain, table, edges, relaxed=False),
        activation_budget_bytes=activation_budget_bytes,
    )
    if greedy is not None and greedy.recompute_ms <= bound_ms * (1 + 1e-9):
        schedule = Schedule(regions=greedy.schedule.regions, solver="ilp")
        return IlpResult(schedule=schedule, recompute_ms=greedy.recompute_ms, gap=0.0, optimal=True)
    cp_model = _load_cp_model()
    model, use, keep, objective = _model(cp_model, chain, table, edges, candidates, budget_units)
    # Our bound in time units, for CP-SAT's search and for stopping it. A plan's objective rounds each
    # used edge, its selective overhead and each keep by at most half a unit: at most one unit per cut
    # (a plan has fewer regions than boundaries) and half a unit per candidate, which this slack covers.
    bound_units = math.floor(bound_ms * TIME_UNITS_PER_MS) - len(chain.boundaries) - len(candidates)
    if bound_ms > 0:
        model.add(objective >= bound_units)
    start_from = greedy.schedule if greedy is not None else hint
    if start_from is not None:
        _add_hint(model, chain, table, edges, use, keep, start_from)
    solver = cp_model.CpSolver()
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = deterministic_time_s
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.relative_gap_limit = RELATIVE_GAP_LIMIT
    status = solver.solve(model, _stop_within_gap(cp_model, bound_units) if bound_ms > 0 else None)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    objective_ms = solver.objective_value / TIME_UNITS_PER_MS if found else math.inf
    if greedy is not None and greedy.recompute_ms < objective_ms:
        schedule, objective_ms = Schedule(regions=greedy.schedule.regions, solver="ilp"), greedy.recompute_ms
    elif found:
        schedule = _decode(edges, use, keep, solver)
    else:
        return None
    # Every kept node's time is part of its region's recompute, so no plan's objective is negative.
    # CP-SAT reports OPTIMAL within RELATIVE_GAP_LIMIT, so the gap comes from the bounds alone.
    proven_ms = max(solver.best_objective_bound / TIME_UNITS_PER_MS if found else 0.0, bound_ms, 0.0)
    gap = max(0.0, objective_ms - proven_ms) / objective_ms if objective_ms > 0 else 0.0
    optimal = gap == 0.0
    return IlpResult(schedule=schedule, recompute_ms=objective_ms, gap=gap, optimal=optimal)


def _stop_within_gap(cp_model: Any, bound_units: int) -> Any:
    """Stops CP-SAT at a plan within RELATIVE_GAP_LIMIT of our bound: CP-SAT's own gap limit sees
    only the bound it proves, which on long chains stays loose for the whole time limit."""

    class StopWithinGap(cp_model.CpSolverSolutionCallback):  # type: ignore[misc]
        def on_solution_callback(self) -> None:
            if self.objective_value <= bound_units * (1 + RELATIVE_GAP_LIMIT):
                self.stop_search()

    return StopWithinGap()


def _model(
    cp_model: Any,
    chain: Chain,
    table: CostTable,
    edges: list[_Edge],
    candidates: list[int],
    budget_units: int,
) -> tuple[Any, list[Any], dict[int, Any], Any]:
    """The CP-SAT model (a path through dp's states with memory and keep side constraints),
    its edge and keep variables, and its objective (recompute in time units)."""
    model = cp_model.CpModel()
    use = [model.new_bool_var(f"use{e}") for e in range(len(edges))]
    keep = {index: model.new_bool_var(f"keep{index}") for index in candidates}
    total_units = _units(sum(chain.sizes.values())) + 1
    outgoing: dict[State, list[Any]] = {}
    incoming: dict[State, list[Any]] = {}
    for e, edge in enumerate(edges):
        outgoing.setdefault(edge.source, []).append(use[e])
        incoming.setdefault(edge.target, []).append(use[e])
    vertices = set(outgoing) | set(incoming)
    retained = {vertex: model.new_int_var(0, total_units, f"retained{vertex}") for vertex in vertices}
    start, end = table.start, (chain.boundaries[-1], frozenset[str]())
    model.add(retained[start] == 0)
    model.add(sum(outgoing[start]) == 1)
    for vertex in vertices:
        if vertex not in (start, end):
            model.add(sum(outgoing.get(vertex, [])) == sum(incoming.get(vertex, [])))
    model.add(sum(incoming.get(end, [])) == 1)

    allowed_in: dict[int, list[Any]] = {index: [] for index in candidates}
    for e, edge in enumerate(edges):
        charged = _units(edge.cost.charged_bytes) + sum(
            _units(delta) * keep[k] for k, delta in edge.keep_charged.items()
        )
        model.add(retained[edge.target] >= retained[edge.source] + charged).only_enforce_if(use[e])
        for j in _relevant_points(edge):
            point = _units(edge.cost.points_bytes[j]) + sum(
                _units(delta[j]) * keep[k] for k, delta in edge.keep_points.items() if delta[j]
            )
            model.add(retained[edge.source] + point <= budget_units).only_enforce_if(use[e])
        for k in edge.keep_points:
            allowed_in[k].append(use[e])
    for k, uses in allowed_in.items():
        model.add(keep[k] <= sum(uses)) if uses else model.add(keep[k] == 0)

    def time_units(ms: float) -> int:
        return round(ms * TIME_UNITS_PER_MS)

    selective = []
    for e, edge in enumerate(edges):
        if edge.keep_points and time_units(edge.selective_ms) > 0:
            keeping = model.new_bool_var(f"selective{e}")
            for k in edge.keep_points:
                model.add(keeping >= keep[k] + use[e] - 1)
            selective.append(time_units(edge.selective_ms) * keeping)

    nodes = chain.graph.nodes
    objective = (
        sum(time_units(edge.cost.recompute_ms) * use[e] for e, edge in enumerate(edges))
        + sum(selective)
        - sum(time_units(nodes[k].forward_ms) * keep[k] for k in candidates)
    )
    model.minimize(objective)
    return model, use, keep, objective


def _hint_path(chain: Chain, table: CostTable, hint: Schedule) -> set[tuple[State, Region]]:
    """The hinted schedule as edge keys: stored regions split at every boundary inside them (stored
    edges span one step), each step from the state the one before it reached."""
    state = table.start
    path: set[tuple[State, Region]] = set()
    for region in hint.regions:
        bounds = [region.start, region.stop]
        if region.policy is RegionPolicy.STORE:
            inner = (c for c in chain.boundaries if region.start < c < region.stop)
            bounds = [region.start, *inner, region.stop]
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            step = Region(start, stop, region.policy)
            match = [t for t in table.transitions.get(state, ()) if t.region == step]
            if not match:
                return path
            path.add((state, step))
            state = match[0].target
    return path


def _add_hint(
    model: Any,
    chain: Chain,
    table: CostTable,
    edges: list[_Edge],
    use: list[Any],
    keep: dict[int, Any],
    hint: Schedule,
) -> None:
    """Warm start: the hinted schedule's regions as edges, and its keeps."""
    wanted = _hint_path(chain, table, hint)
    for e, edge in enumerate(edges):
        model.add_hint(use[e], (edge.source, edge.region) in wanted)
    kept = {index for region in hint.regions for index in region.keep}
    for index, variable in keep.items():
        model.add_hint(variable, index in kept)


def _decode(edges: list[_Edge], use: list[Any], keep: dict[int, Any], solver: Any) -> Schedule:
    regions = []
    for e, edge in enumerate(edges):
        if solver.value(use[e]):
            kept = tuple(k for k in edge.keep_points if solver.value(keep[k]))
            regions.append(Region(edge.region.start, edge.region.stop, edge.region.policy, kept))
    regions.sort(key=lambda region: region.start)
    return Schedule(regions=merge_stored(regions), solver="ilp")
