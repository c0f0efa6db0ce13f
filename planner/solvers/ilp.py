"""`ilp`: OR-tools CP-SAT over region boundaries *and* selective keeps inside checkpointed regions.

The plan space is `dp`'s (regions between cuts, each stored or checkpointed) plus, inside a checkpointed
region, a set of nodes whose outputs are kept instead of replayed (NOTE [selective keeps] in
simulate.py). Keeping an expensive matmul and replaying the cheap pointwise ops around it is how
Megatron's selective recompute saves most activation memory for a few percent of extra compute.

Model (a shortest path with side constraints):

- Path vertices are (cut, whether the region ending there is stored); an edge is a candidate region.
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

from planner.ir import Region, RegionPolicy, Schedule
from planner.simulate import recompute_trigger
from planner.solvers.chain import Chain, RegionCost, keep_effect, region_cost
from planner.solvers.dp import MAX_REGION_SEGMENTS

__all__ = ["IlpResult", "ilp_schedule", "keepable"]

BYTES_UNIT = 1024
TIME_UNITS_PER_MS = 1000
MAX_KEEP_CANDIDATES = 32
"""Keepable nodes offered to the model: the most forward time per cached byte first."""
DETERMINISTIC_SECONDS = 5.0
"""CP-SAT's deterministic time limit (about seconds of one core); wall time is capped separately."""


@dataclass(frozen=True)
class IlpResult:
    schedule: Schedule
    recompute_ms: float
    gap: float
    """(objective - proven bound) / objective; 0 when proven optimal."""
    optimal: bool


@dataclass(frozen=True)
class _Edge:
    source: tuple[int, bool]
    target: tuple[int, bool]
    region: Region
    cost: RegionCost
    keep_points: dict[int, tuple[int, ...]]
    """Per allowed keep node: the change of each point when it is kept."""
    keep_charged: dict[int, int]


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
        and node.allocated_bytes > 0
        and node.forward_ms > 0
        and not (node.random or node.stateful or node.in_place)
    ]
    candidates.sort(
        key=lambda i: chain.graph.nodes[i].forward_ms / chain.graph.nodes[i].allocated_bytes, reverse=True
    )
    return sorted(candidates[:MAX_KEEP_CANDIDATES])


def _allowed_keeps(chain: Chain, region: Region, candidates: list[int]) -> list[int]:
    trigger = recompute_trigger(chain.graph, region)
    if trigger is None:
        return []
    return [
        index
        for index in candidates
        if region.start <= index <= trigger
        and all(chain.last_read.get(name, index) < region.stop for name in chain.graph.nodes[index].creates)
    ]


def _units(size_bytes: float) -> int:
    return math.ceil(size_bytes / BYTES_UNIT)


def _edges(chain: Chain, candidates: list[int]) -> list[_Edge]:
    edges = []
    nodes = chain.graph.nodes
    for i, start in enumerate(chain.cuts[:-1]):
        for stop in chain.cuts[i + 1 : i + 1 + MAX_REGION_SEGMENTS]:
            checkpointable = all(node.checkpointable for node in nodes[start:stop])
            for policy in (RegionPolicy.STORE, RegionPolicy.CHECKPOINT):
                # A stored run of segments costs what its segments cost one by one (the boundary
                # storage is deduplicated by `previous_stores`), so stored edges span one segment.
                if policy is RegionPolicy.STORE and stop != chain.cuts[i + 1]:
                    continue
                if policy is RegionPolicy.CHECKPOINT and not checkpointable:
                    continue
                for previous_stores in (False, True):
                    region = Region(start, stop, policy)
                    cost = region_cost(chain, region, previous_stores=previous_stores)
                    keep_points: dict[int, tuple[int, ...]] = {}
                    keep_charged: dict[int, int] = {}
                    if policy is RegionPolicy.CHECKPOINT:
                        for index in _allowed_keeps(chain, region, candidates):
                            keep_points[index], keep_charged[index] = keep_effect(chain, region, index)
                    edges.append(
                        _Edge(
                            source=(start, previous_stores),
                            target=(stop, policy is RegionPolicy.STORE),
                            region=region,
                            cost=cost,
                            keep_points=keep_points,
                            keep_charged=keep_charged,
                        )
                    )
    return edges


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
    chain: Chain,
    *,
    activation_budget_bytes: float,
    hint: Schedule | None,
    time_limit_s: float,
    seed: int = 0,
) -> IlpResult | None:
    """Least-recompute schedule with keeps; None when the model proves no plan fits."""
    cp_model = _load_cp_model()
    candidates = keepable(chain)
    edges = _edges(chain, candidates)
    model = cp_model.CpModel()
    use = [model.new_bool_var(f"use{e}") for e in range(len(edges))]
    keep = {index: model.new_bool_var(f"keep{index}") for index in candidates}
    budget_units = math.floor(activation_budget_bytes / BYTES_UNIT)
    if budget_units < 0:
        return None
    total_units = _units(sum(chain.sizes.values())) + 1
    vertices = {edge.source for edge in edges} | {edge.target for edge in edges}
    retained = {vertex: model.new_int_var(0, total_units, f"retained{vertex}") for vertex in vertices}
    start, end = (0, False), chain.cuts[-1]
    model.add(retained[start] == 0)
    for vertex in vertices:
        outgoing = [use[e] for e, edge in enumerate(edges) if edge.source == vertex]
        incoming = [use[e] for e, edge in enumerate(edges) if edge.target == vertex]
        if vertex == start:
            model.add(sum(outgoing) == 1)
        elif vertex[0] == end:
            continue
        else:
            model.add(sum(outgoing) == sum(incoming))
    model.add(sum(use[e] for e, edge in enumerate(edges) if edge.target[0] == end) == 1)

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

    nodes = chain.graph.nodes
    model.minimize(
        sum(time_units(edge.cost.recompute_ms) * use[e] for e, edge in enumerate(edges))
        - sum(time_units(nodes[k].forward_ms) * keep[k] for k in candidates)
    )
    if hint is not None:
        _add_hint(model, edges, use, keep, hint)

    solver = cp_model.CpSolver()
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = DETERMINISTIC_SECONDS
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    schedule = _decode(edges, use, keep, solver)
    objective = solver.objective_value
    bound = solver.best_objective_bound
    gap = 0.0 if status == cp_model.OPTIMAL or objective <= 0 else max(0.0, (objective - bound) / objective)
    return IlpResult(
        schedule=schedule,
        recompute_ms=objective / TIME_UNITS_PER_MS,
        gap=gap,
        optimal=status == cp_model.OPTIMAL,
    )


def _add_hint(model: Any, edges: list[_Edge], use: list[Any], keep: dict[int, Any], hint: Schedule) -> None:
    """Warm start: the hinted schedule's regions, split at the cuts the edges use, no keeps."""
    previous_stores = False
    path = []
    for region in hint.regions:
        path.append((region.start, region.stop, region.policy, previous_stores))
        previous_stores = region.policy is RegionPolicy.STORE
    wanted = set(path)
    for e, edge in enumerate(edges):
        key = (edge.region.start, edge.region.stop, edge.region.policy, edge.source[1])
        model.add_hint(use[e], key in wanted)
    for variable in keep.values():
        model.add_hint(variable, False)


def _decode(edges: list[_Edge], use: list[Any], keep: dict[int, Any], solver: Any) -> Schedule:
    regions = []
    for e, edge in enumerate(edges):
        if solver.value(use[e]):
            kept = tuple(k for k in edge.keep_points if solver.value(keep[k]))
            regions.append(Region(edge.region.start, edge.region.stop, edge.region.policy, kept))
    regions.sort(key=lambda region: region.start)
    merged: list[Region] = []
    for region in regions:
        if merged and merged[-1].policy is RegionPolicy.STORE and region.policy is RegionPolicy.STORE:
            merged[-1] = Region(merged[-1].start, region.stop, RegionPolicy.STORE)
        else:
            merged.append(region)
    return Schedule(regions=tuple(merged), solver="ilp")
