"""Every solver through one case table and one validator; `dp` against a brute-force oracle."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from planner.errors import InfeasibleBudget
from planner.ir import ActivationGraph, Schedule
from planner.simulation.step import simulate, store_everything
from planner.solvers import SOLVERS, lowest_peak, solve
from planner.solvers.chain import build_chain
from planner.solvers.dp import Objective, _Partials, _prune
from planner.testing.synthetic_graphs import MIB, all_schedules, chain_graph, random_chain


def validate(graph: ActivationGraph, schedule: Schedule, budget_bytes: int) -> None:
    result = simulate(graph, schedule)
    assert result.peak_bytes <= budget_bytes, (
        f"{schedule.solver}: simulated peak {result.peak_bytes} over budget {budget_bytes} "
        f"in {result.peak_phase.value} at {result.peak_node}"
    )


GRAPHS = {
    "uniform": chain_graph([4] * 8),
    "growing": chain_graph([1, 2, 3, 4, 5, 6, 7]),
    "bottleneck": chain_graph([8, 1, 8, 8, 1, 8, 8, 1]),
    **{f"random-{seed}": random_chain(random.Random(seed), 7) for seed in range(4)},
}


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.0])
def test_solvers_fit_the_budget_or_say_why(solver: str, graph_name: str, fraction: float) -> None:
    graph = GRAPHS[graph_name]
    lowest = lowest_peak(graph)[1].peak_bytes
    baseline = simulate(graph, store_everything(graph)).peak_bytes
    budget = int(lowest + fraction * (baseline - lowest))
    try:
        schedule = solve(graph, budget_bytes=budget, solver=solver)
    except InfeasibleBudget as error:
        assert solver in ("none", "chen"), f"dp must fit any budget >= the lowest peak {lowest}, got {budget}"
        assert error.min_peak_bytes > budget
        return
    validate(graph, schedule, budget)


@pytest.mark.parametrize("seed", range(12))
def test_dp_matches_brute_force_on_small_chains(seed: int) -> None:
    rng = random.Random(seed)
    graph = random_chain(rng, rng.randint(3, 7))
    simulated = [(s, simulate(graph, s)) for s in all_schedules(graph)]
    best_peak = min(result.peak_bytes for _, result in simulated)
    assert lowest_peak(graph)[1].peak_bytes == best_peak
    baseline = simulate(graph, store_everything(graph)).peak_bytes
    for fraction in (0.0, 0.25, 0.5, 0.75):
        budget = int(best_peak + fraction * (baseline - best_peak))
        oracle_ms = min(result.recompute_ms for _, result in simulated if result.peak_bytes <= budget)
        schedule = solve(graph, budget_bytes=budget, solver="dp")
        validate(graph, schedule, budget)
        assert simulate(graph, schedule).recompute_ms == pytest.approx(oracle_ms), f"budget {budget}"


def test_below_the_lowest_peak_raises_with_the_numbers() -> None:
    graph = GRAPHS["uniform"]
    lowest = lowest_peak(graph)[1].peak_bytes
    solve(graph, budget_bytes=lowest, solver="dp")
    with pytest.raises(InfeasibleBudget) as caught:
        solve(graph, budget_bytes=lowest - 1, solver="dp")
    assert caught.value.min_peak_bytes == lowest
    assert caught.value.budget_bytes == lowest - 1
    assert "lowest achievable peak" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_static_state_over_budget_says_checkpointing_cannot_help() -> None:
    graph = GRAPHS["uniform"]
    with pytest.raises(InfeasibleBudget, match="Checkpointing cannot help"):
        solve(graph, budget_bytes=graph.static.parameter_bytes, solver="dp")


def test_unknown_solver_lists_the_registry() -> None:
    with pytest.raises(ValueError, match="chen"):
        solve(GRAPHS["uniform"], budget_bytes=2**40, solver="magic")


def test_more_budget_never_costs_more_recompute() -> None:
    graph = GRAPHS["random-1"]
    lowest = lowest_peak(graph)[1].peak_bytes
    baseline = simulate(graph, store_everything(graph)).peak_bytes
    costs = [
        simulate(
            graph, solve(graph, budget_bytes=int(lowest + f * (baseline - lowest)), solver="dp")
        ).recompute_ms
        for f in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    ]
    assert costs == sorted(costs, reverse=True)
    assert costs[-1] == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_frontier_pruning_keeps_exactly_the_pareto_partials(seed: int) -> None:
    """`_prune` merges runs sorted by retained bytes (ties included) into the Pareto set a naive
    all-pairs filter finds: no kept partial is beaten on both retained bytes and recompute."""
    rng = np.random.default_rng(seed)
    runs = [np.sort(rng.integers(0, 40, size=int(rng.integers(1, 30)))) for _ in range(6)]
    retained = np.concatenate(runs).astype(np.int64)
    recompute = rng.integers(0, 25, size=len(retained)).astype(np.float64)
    partials = _Partials(retained, np.zeros_like(retained), recompute, np.arange(len(retained)))
    kept, thinned = _prune(partials, Objective.RECOMPUTE, total_ms=100.0)
    expected = {
        (int(r), float(c))
        for r, c in zip(retained, recompute, strict=True)
        if not any(
            (r2 <= r and c2 < c) or (r2 < r and c2 <= c) for r2, c2 in zip(retained, recompute, strict=True)
        )
    }
    assert not thinned
    assert list(kept.retained_bytes) == sorted(kept.retained_bytes)
    assert {
        (int(r), float(c)) for r, c in zip(kept.retained_bytes, kept.recompute_ms, strict=True)
    } == expected
    assert len(kept.ids) == len(expected)


def test_a_small_mask_read_by_every_layer_leaves_the_cuts_between_layers() -> None:
    """Like a causal mask at CI size: 1/40 of the largest activation, made first, read by every node.
    Cuts are still found between the nodes, and the plans they give fit by the simulator's count."""
    graph = chain_graph([40, 40, 40, 40])
    mask_bytes = 40 * MIB // 40
    nodes = list(graph.nodes)
    nodes[0] = dataclasses.replace(nodes[0], creates=(*nodes[0].creates, "mask"))
    for index in range(1, 4):
        node = nodes[index]
        nodes[index] = dataclasses.replace(node, reads=(*node.reads, "mask"), saves=(*node.saves, "mask"))
    masked = dataclasses.replace(
        graph, nodes=tuple(nodes), storage_bytes={**graph.storage_bytes, "mask": mask_bytes}
    )
    assert build_chain(masked).boundaries == (0, 1, 2, 3, 4, 5)
    lowest = lowest_peak(masked)[1].peak_bytes
    baseline = simulate(masked, store_everything(masked)).peak_bytes
    assert lowest < baseline
    for budget in (lowest, (lowest + baseline) // 2):
        assert simulate(masked, solve(masked, budget_bytes=budget, solver="dp")).peak_bytes <= budget
