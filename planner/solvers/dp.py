"""`dp`: exact dynamic program over region boundaries (solvers/chain.py).

States are (boundary, the storages crossing it that earlier regions hold; NOTE [held storages]). Each
state keeps the Pareto set of partial schedules by (bytes retained so far, objective): a later region's
peak grows with what earlier regions retain, so a partial schedule is only worth keeping if no other one
at the same state retains less at the same or lower objective. Two objectives share the recursion:

- `minimise_recompute`: least recompute time with every region's peak within the budget (the solver);
- `minimise_peak`: the lowest peak any schedule reaches (`min_peak_bytes`, and the InfeasibleBudget
  message).

A Pareto set is a few numpy arrays (retained bytes, peak bytes, recompute ms, partial id), so extending
it by a region and pruning it are array operations; the region that made each partial and its parent are
kept in a `_History` for unwinding the winner. `tabulate` walks the states reachable from the first
boundary once per graph and lists each state's transitions with their costs (`region_costs.RegionCosts`, which
costs regions of the same structure once). The result is checked with the simulator by the caller (see
solvers/__init__.py).
"""

from __future__ import annotations

import bisect
import enum
import logging
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from planner.ir import Region, RegionPolicy, Schedule, merge_stored
from planner.simulation.step import CheckpointRule
from planner.solvers.chain import Chain, RegionCostSummary, State
from planner.solvers.region_costs import RegionCosts

log = logging.getLogger(__name__)

__all__ = [
    "CostTable",
    "DpResult",
    "least_recompute",
    "min_peak_schedule",
    "region_costs",
    "tabulate",
    "Transition",
]

MAX_FRONTIER = 4096
"""Pareto sets larger than this are thinned to the best partial per band of retained bytes."""
MAX_HELD_VARIANTS = 64
"""States per boundary (which crossing storages are held) beyond which transitions into new ones are
dropped, and the search is no longer exact. Each variant comes from how earlier regions treated the
storages crossing the boundary; skip lists and feature lists of real models reach a few dozen."""

Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Transition:
    """A candidate region from one state to the next, with its variants (keep sets) and their costs."""

    region: Region
    """Without keeps; a variant's `keep` says which nodes it keeps."""
    source: State
    target: State
    variants: tuple[RegionCostSummary, ...]


@dataclass(frozen=True)
class CostTable:
    """Every state reachable from the first boundary, in boundary order, with its transitions."""

    transitions: dict[State, tuple[Transition, ...]]
    complete: bool
    """No state was dropped (MAX_HELD_VARIANTS): searches over the table are exact."""

    @property
    def start(self) -> State:
        return next(iter(self.transitions))

    def with_variants(self, variants: dict[tuple[State, Region], tuple[RegionCostSummary, ...]]) -> CostTable:
        """The same transitions with other variants where `variants` has them."""
        return CostTable(
            transitions={
                state: tuple(
                    Transition(t.region, t.source, t.target, variants.get((t.source, t.region), t.variants))
                    for t in transitions
                )
                for state, transitions in self.transitions.items()
            },
            complete=self.complete,
        )


class Objective(enum.Enum):
    RECOMPUTE = "recompute"
    """Least recompute time (ties: lower peak)."""
    PEAK = "peak"
    """Lowest peak (ties: less recompute)."""


def region_costs(chain: Chain) -> RegionCosts:
    """The region costs `tabulate` reads, sharing structure up to the longest region it tabulates."""
    longest = max(stop - start for start, stops in chain.checkpoint_stops.items() for stop in stops)
    return RegionCosts(chain, max_region_nodes=longest)


def _policies(chain: Chain, start: int, stop: int, rule: CheckpointRule) -> list[RegionPolicy]:
    """Stored regions span one step between boundaries (a stored run costs what its steps cost one by
    one); checkpointed ones any ladder reach that the checkpoint rule allows."""
    policies = [RegionPolicy.STORE] if chain.next_boundary[start] == stop else []
    if rule.allows(chain.graph, start, stop):
        policies.append(RegionPolicy.CHECKPOINT)
    return policies


def _stored_path(costs: RegionCosts) -> list[State]:
    """The states the schedule without checkpointing passes through."""
    chain = costs.chain
    state: State = (0, frozenset())
    path = [state]
    for start, stop in zip(chain.boundaries[:-1], chain.boundaries[1:], strict=True):
        state = (stop, costs.held_out(Region(start, stop, RegionPolicy.STORE), state[1]))
        path.append(state)
    return path


def tabulate(costs: RegionCosts) -> CostTable:
    """Walk the states reachable from the first boundary and cost every transition out of them.

    The states of the schedule without checkpointing are entered first, so that the cap on states per
    boundary never drops them.
    """
    chain = costs.chain
    rule = CheckpointRule.of(chain.graph)
    states_at: dict[int, dict[frozenset[str], None]] = {position: {} for position in chain.boundaries}
    for position, held in _stored_path(costs):
        states_at[position][held] = None
    complete = True
    transitions: dict[State, tuple[Transition, ...]] = {}
    for start in chain.boundaries[:-1]:
        for held_in in list(states_at[start]):
            found = []
            for stop in chain.checkpoint_stops[start]:
                for policy in _policies(chain, start, stop, rule):
                    region = Region(start, stop, policy)
                    held_out = costs.held_out(region, held_in)
                    if held_out not in states_at[stop]:
                        if len(states_at[stop]) >= MAX_HELD_VARIANTS:
                            complete = False
                            continue
                        states_at[stop][held_out] = None
                    summary = costs.summary(region, held_in=held_in)
                    found.append(Transition(region, (start, held_in), (stop, held_out), (summary,)))
            transitions[(start, held_in)] = tuple(found)
    transitions[(chain.boundaries[-1], frozenset())] = ()
    if not complete:
        log.warning("more than %d held-storage states at a boundary: dp is not exact", MAX_HELD_VARIANTS)
    return CostTable(transitions=transitions, complete=complete)


@dataclass
class _History:
    """Where every partial schedule came from: chunks of (first id, parent ids, the region added)."""

    first_ids: list[int] = field(default_factory=lambda: [0])
    parents: list[Ints] = field(default_factory=lambda: [np.array([-1], dtype=np.int64)])
    regions: list[Region | None] = field(default_factory=lambda: [None])
    next_id: int = 1

    def add(self, parent_ids: Ints, region: Region) -> Ints:
        ids = np.arange(self.next_id, self.next_id + len(parent_ids), dtype=np.int64)
        self.first_ids.append(self.next_id)
        self.parents.append(parent_ids)
        self.regions.append(region)
        self.next_id += len(parent_ids)
        return ids

    def unwind(self, partial_id: int) -> list[Region]:
        """Regions of the schedule that ends in `partial_id`, first to last."""
        regions: list[Region] = []
        while partial_id > 0:
            chunk = bisect.bisect_right(self.first_ids, partial_id) - 1
            region = self.regions[chunk]
            assert region is not None, "only the empty root partial has no region"
            regions.append(region)
            partial_id = int(self.parents[chunk][partial_id - self.first_ids[chunk]])
        return regions[::-1]


@dataclass
class _Partials:
    """Partial schedules ending at one state, as parallel arrays."""

    retained_bytes: Ints
    peak_bytes: Ints
    recompute_ms: Floats
    ids: Ints

    @staticmethod
    def concatenate(parts: list[_Partials]) -> _Partials:
        return _Partials(
            retained_bytes=np.concatenate([p.retained_bytes for p in parts]),
            peak_bytes=np.concatenate([p.peak_bytes for p in parts]),
            recompute_ms=np.concatenate([p.recompute_ms for p in parts]),
            ids=np.concatenate([p.ids for p in parts]),
        )

    def take(self, index: Ints) -> _Partials:
        return _Partials(
            self.retained_bytes[index], self.peak_bytes[index], self.recompute_ms[index], self.ids[index]
        )


def _objective(partials: _Partials, objective: Objective, total_ms: float) -> Floats:
    """One float to minimise. For PEAK, recompute breaks ties below one byte of peak."""
    if objective is Objective.RECOMPUTE:
        return partials.recompute_ms
    return partials.peak_bytes.astype(np.float64) + 0.5 * partials.recompute_ms / (total_ms + 1.0)


def _prune(partials: _Partials, objective: Objective, total_ms: float) -> tuple[_Partials, bool]:
    """Partials that no other beats on both retained bytes and the objective, by retained bytes; and
    whether the set had to be thinned (then the search is no longer exact)."""
    key = _objective(partials, objective, total_ms)
    # The parts were each sorted by retained bytes: a stable sort merges those runs fast.
    order = np.argsort(partials.retained_bytes, kind="stable")
    sorted_key = key[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], sorted_key[:-1])))
    improving = order[sorted_key < best_before]
    # Among improving partials of equal retained bytes the last has the least objective.
    retained = partials.retained_bytes[improving]
    kept = partials.take(improving[np.concatenate((retained[1:] != retained[:-1], [True]))])
    if len(kept.ids) > MAX_FRONTIER:
        return _thin(kept), True
    return kept, False


def _thin(frontier: _Partials) -> _Partials:
    """At most MAX_FRONTIER + 1 partials: the best (last) one per band of retained bytes.

    The frontier is sorted by retained bytes with the objective falling, so the last partial of each
    band is its best; both ends survive (least retained, best objective), so thinning never loses the
    answer when memory is plentiful.
    """
    retained = frontier.retained_bytes
    low, high = int(retained[0]), int(retained[-1])
    width = (high - low) / MAX_FRONTIER or 1.0
    band = ((retained - low) / width).astype(np.int64)
    last_of_band = np.flatnonzero(np.concatenate((band[1:] != band[:-1], [True])))
    chosen = np.union1d([0], last_of_band)
    return frontier.take(chosen)


def _extend(sources: _Partials, cost: RegionCostSummary, limit_bytes: float) -> _Partials:
    """Each source followed by a region of `cost` while the region's peak stays within `limit_bytes`.

    Sources are sorted by retained bytes, so those that fit form a prefix. The result's ids are its
    parents' ids until `_History.add` gives it its own.
    """
    count = int(np.searchsorted(sources.retained_bytes, limit_bytes - cost.peak_bytes, side="right"))
    retained = sources.retained_bytes[:count]
    return _Partials(
        retained_bytes=retained + cost.charged_bytes,
        peak_bytes=np.maximum(sources.peak_bytes[:count], retained + cost.peak_bytes),
        recompute_ms=sources.recompute_ms[:count] + cost.recompute_ms,
        ids=sources.ids[:count],
    )


@dataclass(frozen=True)
class _Found:
    regions: list[Region]
    recompute_ms: float
    exact: bool
    """No Pareto set was thinned: the result is optimal over the table."""


def _search(table: CostTable, *, limit_bytes: float, objective: Objective, total_ms: float) -> _Found | None:
    exact = table.complete
    history = _History()
    root = _Partials(
        np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(1, dtype=np.int64)
    )
    pending: dict[State, list[_Partials]] = {table.start: [root]}
    finals: list[_Partials] = []
    for state, transitions in table.transitions.items():
        parts = pending.pop(state, None)
        if not parts:
            continue
        if not transitions:
            finals += parts
            continue
        sources, thinned = _prune(_Partials.concatenate(parts), objective, total_ms)
        exact = exact and not thinned
        for transition in transitions:
            region = transition.region
            for cost in transition.variants:
                extended = _extend(sources, cost, limit_bytes)
                if len(extended.ids):
                    extended.ids = history.add(
                        extended.ids, Region(region.start, region.stop, region.policy, cost.keep)
                    )
                    pending.setdefault(transition.target, []).append(extended)
    if not finals:
        return None
    every = _Partials.concatenate(finals)
    best = np.lexsort((every.peak_bytes, _objective(every, objective, total_ms)))[0]
    return _Found(history.unwind(int(every.ids[best])), float(every.recompute_ms[best]), exact)


def _total_ms(chain: Chain) -> float:
    return sum(node.forward_ms for node in chain.graph.nodes)


@dataclass(frozen=True)
class DpResult:
    schedule: Schedule
    recompute_ms: float
    """By the table's costs."""
    exact: bool
    """Nothing was thinned: no schedule over the table's regions and variants has less recompute."""


def least_recompute(chain: Chain, table: CostTable, *, activation_budget_bytes: float) -> DpResult | None:
    """Least-recompute schedule over `table` whose activation-side peak is within the budget.

    None when no schedule fits (thinning keeps the least-retained partial of every state, so this is
    exact even when the recompute is not).
    """
    found = _search(
        table, limit_bytes=activation_budget_bytes, objective=Objective.RECOMPUTE, total_ms=_total_ms(chain)
    )
    if found is None:
        return None
    schedule = Schedule(regions=merge_stored(found.regions), solver="dp")
    return DpResult(schedule=schedule, recompute_ms=found.recompute_ms, exact=found.exact)


def min_peak_schedule(chain: Chain, table: CostTable) -> Schedule:
    """The schedule with the lowest activation-side peak (least recompute among equals)."""
    found = _search(table, limit_bytes=float("inf"), objective=Objective.PEAK, total_ms=_total_ms(chain))
    assert found is not None, "an unconstrained search always finds the store-everything schedule"
    return Schedule(regions=merge_stored(found.regions), solver="dp")
