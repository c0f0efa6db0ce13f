"""Plans on DAG-shaped graphs: region costs entered with held storages compose to the simulated peak,
and `dp` finds the brute-force optimum over every tiling of the nodes (NOTE [held storages]), also
where nodes save what later nodes make, as compiled steps do (NOTE [saved before made])."""

from __future__ import annotations

import random

import pytest

from planner.ir import ActivationGraph, Phase, Region, RegionPolicy, Schedule
from planner.simulation.step import simulate
from planner.solvers import _tables, lowest_peak, solve
from planner.solvers.chain import region_cost
from planner.testing.synthetic_graphs import all_schedules, random_dag, saved_before_made

DAGS = {f"dag-{seed}": random_dag(random.Random(seed), 7) for seed in range(8)} | {
    f"saved-before-made-{seed}": saved_before_made(
        random_dag(random.Random(seed), 7), random.Random(100 + seed)
    )
    for seed in range(4, 8)
}


def activation_peak_bytes(graph: ActivationGraph, schedule: Schedule) -> int:
    """The simulated peak of forward and backward, less what is resident all step."""
    trace = simulate(graph, schedule).trace
    live = max(step.live_bytes for step in trace if step.phase is not Phase.OPTIMIZER)
    return live - graph.static.resident_bytes


def composed_peak_bytes(graph: ActivationGraph, schedule: Schedule) -> int:
    """The peak by region costs: each region's points on top of what the regions before it retain,
    walked through the solver's states (stored regions one step between boundaries at a time)."""
    tables = _tables(graph)
    state = tables.table.start
    retained = peak = 0
    for region in schedule.regions:
        bounds = [region.start, region.stop]
        if region.policy is RegionPolicy.STORE:
            inner = [c for c in tables.chain.boundaries if region.start < c < region.stop]
            bounds = [region.start, *inner, region.stop]
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            step = Region(start, stop, region.policy, region.keep)
            cost = region_cost(tables.chain, step, held_in=state[1])
            peak = max(peak, retained + cost.peak_bytes)
            retained += cost.charged_bytes
            state = (stop, cost.held_out)
    return peak


@pytest.mark.parametrize("name", sorted(DAGS))
def test_region_costs_compose_to_the_simulated_peak(name: str) -> None:
    graph = DAGS[name]
    schedules = list(all_schedules(graph))
    for schedule in random.Random(1).sample(schedules, min(300, len(schedules))):
        assert composed_peak_bytes(graph, schedule) == activation_peak_bytes(graph, schedule), schedule


@pytest.mark.parametrize("name", sorted(DAGS))
def test_lowest_peak_is_the_brute_force_minimum(name: str) -> None:
    graph = DAGS[name]
    brute_force = min(simulate(graph, schedule).peak_bytes for schedule in all_schedules(graph))
    assert lowest_peak(graph)[1].peak_bytes == brute_force


@pytest.mark.parametrize("solver", ["dp", "ilp"])
@pytest.mark.parametrize("name", sorted(DAGS))
def test_least_recompute_is_the_brute_force_optimum(name: str, solver: str) -> None:
    graph = DAGS[name]
    results = [simulate(graph, schedule) for schedule in all_schedules(graph)]
    lowest = min(result.peak_bytes for result in results)
    highest = max(result.peak_bytes for result in results)
    for fraction in (0.0, 0.25, 0.6):
        budget = lowest + int(fraction * (highest - lowest))
        oracle_ms = min(result.recompute_ms for result in results if result.peak_bytes <= budget)
        planned = simulate(graph, solve(graph, budget_bytes=budget, solver=solver))
        assert planned.peak_bytes <= budget
        assert planned.recompute_ms == pytest.approx(oracle_ms, abs=1e-9), f"budget {budget}"
