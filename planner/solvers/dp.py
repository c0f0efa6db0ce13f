"""`dp`: exact dynamic program over region boundaries at the cuts of the chain view.

States are (cut, policy of the region that ends there). Each state keeps the Pareto set of partial
schedules by (bytes retained so far, objective): a later region's peak grows with what earlier regions
retain, so a partial schedule is only worth keeping if no other one retains less at the same or lower
objective. Two objectives share the recursion:

- `minimise_recompute`: least recompute time with every region's peak within the budget (the solver);
- `minimise_peak`: the lowest peak any schedule reaches (`min_peak_bytes`, and the InfeasibleBudget
  message).

Costs come from `chain.region_cost`; tabulating them is O(cuts^2 * nodes), the recursion
O(cuts^2 * frontier). The result is checked with the simulator by the caller (see solvers/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.ir import Region, RegionPolicy, Schedule
from planner.solvers.chain import Chain, RegionCost, region_cost

__all__ = ["dp_schedule", "min_peak_schedule", "CostTable", "tabulate"]

MAX_REGION_SEGMENTS = 24
"""Longest checkpointed region, in segments between cuts (sqrt(n)-sized regions are far shorter)."""
MAX_FRONTIER = 256
"""Pareto sets larger than this are thinned; bytes are then rounded up, never down."""


@dataclass(frozen=True)
class _Partial:
    retained_bytes: int
    peak_bytes: int
    recompute_ms: float
    region: Region | None
    parent: _Partial | None


CostTable = dict[tuple[int, int, RegionPolicy, bool], RegionCost]


def tabulate(chain: Chain) -> CostTable:
    """Region costs for pairs of cuts, policy and previous policy.

    Stored regions span one segment: a stored run of segments costs what its segments cost one by
    one (the storage crossing each cut is deduplicated through `previous_stores`). Checkpointed
    regions span up to MAX_REGION_SEGMENTS segments, which bounds the table at O(cuts) entries.
    """
    table: CostTable = {}
    nodes = chain.graph.nodes
    cuts = chain.cuts
    for i, start in enumerate(cuts[:-1]):
        for j, stop in enumerate(cuts[i + 1 : i + 1 + MAX_REGION_SEGMENTS]):
            policies = [RegionPolicy.STORE] if j == 0 else []
            if all(node.checkpointable for node in nodes[start:stop]):
                policies.append(RegionPolicy.CHECKPOINT)
            for policy in policies:
                for previous_stores in (False, True):
                    region = Region(start, stop, policy)
                    table[(start, stop, policy, previous_stores)] = region_cost(
                        chain, region, previous_stores=previous_stores
                    )
    return table


def _prune(partials: list[_Partial], key: Callable[[_Partial], float]) -> list[_Partial]:
    """Keep partials that no other beats on both retained bytes and `key`."""
    partials.sort(key=lambda p: (p.retained_bytes, key(p)))
    kept: list[_Partial] = []
    best = float("inf")
    for partial in partials:
        if key(partial) < best:
            kept.append(partial)
            best = key(partial)
    if len(kept) > MAX_FRONTIER:
        kept = _thin(kept)
    return kept


def _thin(frontier: list[_Partial]) -> list[_Partial]:
    """At most MAX_FRONTIER partials: the best (last) one per band of retained bytes.

    The frontier is sorted by retained bytes with `key` falling, so the last partial of each band is
    its best; both ends survive (least retained, best key), so thinning never loses the answer when
    memory is plentiful.
    """
    low, high = frontier[0].retained_bytes, frontier[-1].retained_bytes
    width = (high - low) / MAX_FRONTIER or 1.0
    best_in_band: dict[int, _Partial] = {}
    for partial in frontier:
        best_in_band[int((partial.retained_bytes - low) / width)] = partial
    return [frontier[0], *(p for p in best_in_band.values() if p is not frontier[0])]


def _search(
    chain: Chain,
    table: CostTable,
    *,
    limit_bytes: float,
    key: Callable[[_Partial], float],
) -> _Partial | None:
    cuts = chain.cuts
    frontier: dict[tuple[int, bool], list[_Partial]] = {(0, False): [_Partial(0, 0, 0.0, None, None)]}
    for i, start in enumerate(cuts[:-1]):
        for previous_stores in (False, True):
            if (start, previous_stores) not in frontier:
                continue
            sources = frontier[(start, previous_stores)] = _prune(frontier[(start, previous_stores)], key)
            for stop in cuts[i + 1 : i + 1 + MAX_REGION_SEGMENTS]:
                for policy in (RegionPolicy.STORE, RegionPolicy.CHECKPOINT):
                    cost = table.get((start, stop, policy, previous_stores))
                    if cost is not None:
                        bucket = frontier.setdefault((stop, policy is RegionPolicy.STORE), [])
                        bucket.extend(_extend(sources, Region(start, stop, policy), cost, limit_bytes))
    finals = frontier.get((cuts[-1], False), []) + frontier.get((cuts[-1], True), [])
    if not finals:
        return None
    return min(finals, key=lambda p: (key(p), p.peak_bytes))


def _extend(sources: list[_Partial], region: Region, cost: RegionCost, limit_bytes: float) -> list[_Partial]:
    """Each source followed by `region`, when the region's peak stays within `limit_bytes`.

    Sources come sorted by retained bytes, so once one overflows the limit every later one does.
    """
    extended = []
    for source in sources:
        if source.retained_bytes + cost.peak_bytes > limit_bytes:
            break
        extended.append(
            _Partial(
                retained_bytes=source.retained_bytes + cost.charged_bytes,
                peak_bytes=max(source.peak_bytes, source.retained_bytes + cost.peak_bytes),
                recompute_ms=source.recompute_ms + cost.recompute_ms,
                region=region,
                parent=source,
            )
        )
    return extended


def _unwind(final: _Partial, solver: str) -> Schedule:
    regions: list[Region] = []
    partial: _Partial | None = final
    while partial is not None and partial.region is not None:
        regions.append(partial.region)
        partial = partial.parent
    return Schedule(regions=tuple(_merge_stored(regions[::-1])), solver=solver)


def _merge_stored(regions: list[Region]) -> list[Region]:
    """Adjacent STORE regions are one region: fewer submodules, same memory."""
    merged: list[Region] = []
    for region in regions:
        if merged and merged[-1].policy is RegionPolicy.STORE and region.policy is RegionPolicy.STORE:
            merged[-1] = Region(merged[-1].start, region.stop, RegionPolicy.STORE)
        else:
            merged.append(region)
    return merged


def dp_schedule(chain: Chain, table: CostTable, *, activation_budget_bytes: float) -> Schedule | None:
    """Least-recompute schedule whose activation-side peak is within `activation_budget_bytes`."""
    final = _search(chain, table, limit_bytes=activation_budget_bytes, key=lambda p: p.recompute_ms)
    return _unwind(final, "dp") if final is not None else None


def min_peak_schedule(chain: Chain, table: CostTable) -> Schedule:
    """The schedule with the lowest activation-side peak (least recompute among equals)."""
    final = _search(
        chain, table, limit_bytes=float("inf"), key=lambda p: p.peak_bytes + p.recompute_ms * 1e-9
    )
    assert final is not None, "an unconstrained search always finds the store-everything schedule"
    return _unwind(final, "dp")
