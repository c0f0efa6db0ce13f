"""`dp`: exact dynamic program over region boundaries at the cuts of the chain view.

States are (cut, policy of the region that ends there). Each state keeps the Pareto set of partial
schedules by (bytes retained so far, objective): a later region's peak grows with what earlier regions
retain, so a partial schedule is only worth keeping if no other one retains less at the same or lower
objective. Two objectives share the recursion:

- `minimise_recompute`: least recompute time with every region's peak within the budget (the solver);
- `minimise_peak`: the lowest peak any schedule reaches (`min_peak_bytes`, and the InfeasibleBudget
  message).

A Pareto set is a few numpy arrays (retained bytes, peak bytes, recompute ms, partial id), so extending
it by a region and pruning it are array operations; the region that made each partial and its parent are
kept in a `_History` for unwinding the winner. Costs come from `chain.region_cost`; tabulating them is
O(cuts * MAX_REGION_SEGMENTS * nodes) at most, and regions with the same structure (repeated blocks) are
costed once (see `chain.RegionCosts`). The result is checked with the simulator by the caller (see
solvers/__init__.py).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from planner.ir import Region, RegionPolicy, Schedule
from planner.solvers.chain import Chain, RegionCosts, RegionSummary

__all__ = [
    "CostTable",
    "DpResult",
    "dp_schedule",
    "least_recompute",
    "min_peak_schedule",
    "region_costs",
    "tabulate",
]

MAX_REGION_SEGMENTS = 16
"""Longest checkpointed region, in segments between cuts. The lowest peaks come from regions of about
sqrt(cuts) <= sqrt(MAX_CUTS) ~ 10 segments; on synthetic stacks of 200-2,000 nodes a limit of 24 found
plans within 0.3 % of this one's recompute, at twice the tabulation time."""
MAX_FRONTIER = 4096
"""Pareto sets larger than this are thinned to the best partial per band of retained bytes."""

CostTable = dict[tuple[int, int, RegionPolicy, bool], tuple[RegionSummary, ...]]
"""(start, stop, policy, previous region stores) -> the region's variants (keep sets) and their costs."""
Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]


class Objective(enum.Enum):
    RECOMPUTE = "recompute"
    """Least recompute time (ties: lower peak)."""
    PEAK = "peak"
    """Lowest peak (ties: less recompute)."""


def region_costs(chain: Chain) -> RegionCosts:
    """The region costs `tabulate` reads, sharing structure up to the longest region it tabulates."""
    cuts = chain.cuts
    longest = max(cuts[min(i + MAX_REGION_SEGMENTS, len(cuts) - 1)] - cuts[i] for i in range(len(cuts) - 1))
    return RegionCosts(chain, max_region_nodes=longest)


def tabulate(costs: RegionCosts) -> CostTable:
    """Region costs for pairs of cuts, policy and previous policy.

    Stored regions span one segment: a stored run of segments costs what its segments cost one by
    one (the storage crossing each cut is deduplicated through `previous_stores`). Checkpointed
    regions span up to MAX_REGION_SEGMENTS segments, which bounds the table at O(cuts) entries.
    """
    chain = costs.chain
    nodes = chain.graph.nodes
    cuts = chain.cuts
    table: CostTable = {}
    for i, start in enumerate(cuts[:-1]):
        for j, stop in enumerate(cuts[i + 1 : i + 1 + MAX_REGION_SEGMENTS]):
            policies = [RegionPolicy.STORE] if j == 0 else []
            if all(node.checkpointable for node in nodes[start:stop]):
                policies.append(RegionPolicy.CHECKPOINT)
            for policy in policies:
                for previous_stores in (False, True):
                    region = Region(start, stop, policy)
                    table[(start, stop, policy, previous_stores)] = (
                        costs.summary(region, previous_stores=previous_stores),
                    )
    return table


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


def _extend(sources: _Partials, cost: RegionSummary, limit_bytes: float) -> _Partials:
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


def _search(chain: Chain, table: CostTable, *, limit_bytes: float, objective: Objective) -> _Found | None:
    cuts = chain.cuts
    exact = True
    total_ms = sum(node.forward_ms for node in chain.graph.nodes)
    history = _History()
    root = _Partials(
        np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(1, dtype=np.int64)
    )
    pending: dict[tuple[int, bool], list[_Partials]] = {(0, False): [root]}
    for i, start in enumerate(cuts[:-1]):
        for previous_stores in (False, True):
            parts = pending.pop((start, previous_stores), None)
            if not parts:
                continue
            sources, thinned = _prune(_Partials.concatenate(parts), objective, total_ms)
            exact = exact and not thinned
            for stop in cuts[i + 1 : i + 1 + MAX_REGION_SEGMENTS]:
                for policy in (RegionPolicy.STORE, RegionPolicy.CHECKPOINT):
                    for cost in table.get((start, stop, policy, previous_stores), ()):
                        extended = _extend(sources, cost, limit_bytes)
                        if len(extended.ids):
                            extended.ids = history.add(extended.ids, Region(start, stop, policy, cost.keep))
                            pending.setdefault((stop, policy is RegionPolicy.STORE), []).append(extended)
    finals = pending.get((cuts[-1], False), []) + pending.get((cuts[-1], True), [])
    if not finals:
        return None
    every = _Partials.concatenate(finals)
    best = np.lexsort((every.peak_bytes, _objective(every, objective, total_ms)))[0]
    return _Found(history.unwind(int(every.ids[best])), float(every.recompute_ms[best]), exact)


def _merge_stored(regions: list[Region]) -> list[Region]:
    """Adjacent STORE regions are one region: fewer submodules, same memory."""
    merged: list[Region] = []
    for region in regions:
        if merged and merged[-1].policy is RegionPolicy.STORE and region.policy is RegionPolicy.STORE:
            merged[-1] = Region(merged[-1].start, region.stop, RegionPolicy.STORE)
        else:
            merged.append(region)
    return merged


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
    found = _search(chain, table, limit_bytes=activation_budget_bytes, objective=Objective.RECOMPUTE)
    if found is None:
        return None
    schedule = Schedule(regions=tuple(_merge_stored(found.regions)), solver="dp")
    return DpResult(schedule=schedule, recompute_ms=found.recompute_ms, exact=found.exact)


def dp_schedule(chain: Chain, table: CostTable, *, activation_budget_bytes: float) -> Schedule | None:
    """Least-recompute schedule whose activation-side peak is within `activation_budget_bytes`."""
    result = least_recompute(chain, table, activation_budget_bytes=activation_budget_bytes)
    return result.schedule if result is not None else None


def min_peak_schedule(chain: Chain, table: CostTable) -> Schedule:
    """The schedule with the lowest activation-side peak (least recompute among equals)."""
    found = _search(chain, table, limit_bytes=float("inf"), objective=Objective.PEAK)
    assert found is not None, "an unconstrained search always finds the store-everything schedule"
    return Schedule(regions=tuple(_merge_stored(found.regions)), solver="dp")
