"""`ilp` (CP-SAT with selective keeps) against brute force over the same plan space, and against `dp`."""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import planner.solvers as planner_solvers
from planner.ir import ActivationGraph, Region, RegionPolicy, Schedule
from planner.simulation.replay import stops_before_outputs
from planner.simulation.step import recompute_trigger, simulate, store_everything
from planner.solvers import _tables, lowest_peak, solve
from planner.solvers.chain import keep_effect, region_cost
from planner.solvers.ilp import DETERMINISTIC_SECONDS, _allowed_keeps, _load_cp_model, ilp_schedule, keepable
from planner.testing.synthetic_graphs import (
    all_schedules,
    keepable_chain,
    residual_graph,
    with_selective_price,
)


def with_keeps(graph: ActivationGraph, schedule: Schedule) -> Iterator[Schedule]:
    """Every assignment of allowed keep sets to the checkpointed regions of `schedule`."""
    chain = _tables(graph).chain
    options = []
    for region in schedule.regions:
        allowed = (
            _allowed_keeps(chain, region, keepable(chain)) if region.policy is RegionPolicy.CHECKPOINT else []
        )
        subsets = [
            subset for size in range(len(allowed) + 1) for subset in itertools.combinations(allowed, size)
        ]
        options.append([Region(region.start, region.stop, region.policy, subset) for subset in subsets])
    for regions in itertools.product(*options):
        yield Schedule(regions=tuple(regions), solver="brute-force")


def brute_force_optima(graph: ActivationGraph) -> Iterator[tuple[int, float]]:
    """(budget, least recompute of any plan with keeps that fits it) at three budgets."""
    simulated = [
        simulate(graph, candidate)
        for schedule in all_schedules(graph)
        for candidate in with_keeps(graph, schedule)
    ]
    lowest = lowest_peak(graph)[1].peak_bytes
    baseline = simulate(graph, store_everything(graph)).peak_bytes
    for fraction in (0.1, 0.5, 0.9):
        budget = int(lowest + fraction * (baseline - lowest))
        yield budget, min(result.recompute_ms for result in simulated if result.peak_bytes <= budget)


def with_selective_overhead(
    graph: ActivationGraph, rng: random.Random, per_operator_ms: float
) -> ActivationGraph:
    """`graph` with 1-3 operators per node and a selective policy costing `per_operator_ms` on each."""
    return with_selective_price(graph, [rng.randint(1, 3) for _ in graph.nodes], per_operator_ms)


@pytest.mark.parametrize("per_operator_ms", [0.0, 0.3])
@pytest.mark.parametrize("seed", range(8))
def test_ilp_matches_brute_force_with_keeps(seed: int, per_operator_ms: float) -> None:
    """With the selective policy's overhead as well: the brute force pays it through `simulate`."""
    rng = random.Random(100 + seed)
    graph = with_selective_overhead(keepable_chain(rng, rng.randint(4, 6)), rng, per_operator_ms)
    for budget, oracle_ms in brute_force_optima(graph):
        schedule = solve(graph, budget_bytes=budget, solver="ilp")
        result = simulate(graph, schedule)
        assert result.peak_bytes <= budget
        assert result.recompute_ms == pytest.approx(oracle_ms, abs=1e-3), f"budget {budget}: {schedule}"
        dp_ms = simulate(graph, solve(graph, budget_bytes=budget, solver="dp")).recompute_ms
        assert result.recompute_ms <= dp_ms + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_keep_effect_equals_differencing_region_costs(seed: int) -> None:
    graph = keepable_chain(random.Random(seed), 8)
    chain = _tables(graph).chain
    for start, stop in itertools.combinations(chain.boundaries, 2):
        region = Region(start, stop, RegionPolicy.CHECKPOINT)
        if (
            not all(node.checkpointable for node in graph.nodes[start:stop])
            or recompute_trigger(graph, region) is None
        ):
            continue
        base = region_cost(chain, region, held_in=frozenset())
        for index in _allowed_keeps(chain, region, keepable(chain)):
            kept = region_cost(chain, Region(start, stop, region.policy, (index,)), held_in=frozenset())
            points, charged = keep_effect(chain, region, index)
            assert points == tuple(a - b for a, b in zip(kept.points_bytes, base.points_bytes, strict=True))
            assert charged == kept.charged_bytes - base.charged_bytes


@pytest.mark.parametrize("per_operator_ms", [0.0, 0.3])
@pytest.mark.parametrize("seed", range(4))
def test_reported_gap_brackets_the_brute_force_optimum(seed: int, per_operator_ms: float) -> None:
    """objective * (1 - gap) is a proven lower bound: never above the true optimum."""
    rng = random.Random(200 + seed)
    graph = with_selective_overhead(keepable_chain(rng, rng.randint(4, 6)), rng, per_operator_ms)
    tables = _tables(graph)
    for budget, oracle_ms in brute_force_optima(graph):
        result = ilp_schedule(
            tables.costs,
            tables.table,
            activation_budget_bytes=budget - graph.static.resident_bytes,
            hint=None,
            time_limit_s=10,
        )
        assert result is not None
        assert 0.0 <= result.gap <= 1.0
        assert result.recompute_ms * (1 - result.gap) <= oracle_ms + 1e-3 <= result.recompute_ms + 2e-3


def test_keeps_on_a_long_stack_beat_dp_with_a_small_proven_gap() -> None:
    graph = residual_graph(node_count=301, distinct_blocks=3)
    lowest = lowest_peak(graph)[1].peak_bytes
    baseline = simulate(graph, store_everything(graph)).peak_bytes
    budget = (lowest + baseline) // 2
    ilp = solve(graph, budget_bytes=budget, solver="ilp")
    dp_ms = simulate(graph, solve(graph, budget_bytes=budget, solver="dp")).recompute_ms
    result = simulate(graph, ilp)
    assert result.peak_bytes <= budget
    assert any(region.keep for region in ilp.regions)
    assert result.recompute_ms < dp_ms
    assert ilp.gap <= 0.01


def test_a_trigger_that_ends_its_replay_before_running_is_never_kept() -> None:
    """Its operator does not run in the replay (NOTE [early stop]), so keeping it saves no time and
    would hold its outputs from forward to backward."""
    graph = keepable_chain(random.Random(3), 6)
    chain = _tables(graph).chain
    early = [
        (start, trigger)
        for start in range(1, len(graph.nodes) - 1)
        for stop in range(start + 1, len(graph.nodes))
        if (trigger := recompute_trigger(graph, Region(start, stop, RegionPolicy.CHECKPOINT))) is not None
        and stops_before_outputs(graph.nodes[trigger])
        and trigger in keepable(chain)
    ]
    assert early, "the chain has checkpointable regions whose trigger stops the replay early"
    for start, trigger in early:
        region = Region(start, trigger + 1, RegionPolicy.CHECKPOINT)
        assert trigger not in _allowed_keeps(chain, region, keepable(chain))
        kept = Region(start, trigger + 1, RegionPolicy.CHECKPOINT, (trigger,))
        assert recompute_ms_around(graph, kept) == pytest.approx(recompute_ms_around(graph, region))


def recompute_ms_around(graph: ActivationGraph, middle: Region) -> float:
    """Recompute of the schedule that stores everything but `middle`."""
    regions = (
        Region(0, middle.start, RegionPolicy.STORE),
        middle,
        Region(middle.stop, len(graph.nodes), RegionPolicy.STORE),
    )
    return simulate(graph, Schedule(regions=regions, solver="test")).recompute_ms


def test_keeps_that_cost_more_than_they_save_are_dropped() -> None:
    """Priced at 1 ms per operator, the selective policy outweighs any replay a keep saves: ilp
    plans without keeps itself (a fallback to dp's plan would have no gap), recomputing no more than dp's."""
    graph = with_selective_overhead(residual_graph(node_count=301, distinct_blocks=3), random.Random(0), 1.0)
    lowest = lowest_peak(graph)[1].peak_bytes
    baseline = simulate(graph, store_everything(graph)).peak_bytes
    budget = (lowest + baseline) // 2
    ilp = solve(graph, budget_bytes=budget, solver="ilp")
    dp_ms = simulate(graph, solve(graph, budget_bytes=budget, solver="dp")).recompute_ms
    assert not any(region.keep for region in ilp.regions)
    assert not math.isnan(ilp.gap)
    assert simulate(graph, ilp).recompute_ms <= dp_ms + 1e-9


def test_missing_ortools_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ortools.sat.python.cp_model", None)
    with pytest.raises(ImportError, match=r"pip install 'ortools"):
        _load_cp_model()


def test_auto_gives_cp_sat_a_shorter_deterministic_budget_than_ilp(monkeypatch: pytest.MonkeyPatch) -> None:
    budgets: list[float] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        budgets.append(kwargs["deterministic_time_s"])
        return ilp_schedule(*args, **kwargs)

    monkeypatch.setattr(planner_solvers, "ilp_schedule", recording)
    graph = keepable_chain(random.Random(7), 6)
    budget = (lowest_peak(graph)[1].peak_bytes + simulate(graph, store_everything(graph)).peak_bytes) // 2
    auto = solve(graph, budget_bytes=budget, solver="auto")
    solve(graph, budget_bytes=budget, solver="ilp")
    assert budgets == [planner_solvers.AUTO_ILP_DETERMINISTIC_S, DETERMINISTIC_SECONDS]
    assert (
        simulate(graph, auto).recompute_ms
        <= simulate(graph, solve(graph, budget_bytes=budget, solver="dp")).recompute_ms
    )
