"""Posted graphs: validation rules, the synthetic graphs, and the torch-free frontier."""

from __future__ import annotations

import dataclasses
import math

import pytest

from planner.errors import InvalidGraph
from planner.ir import ActivationGraph
from planner.planning.graph import frontier_budgets, pareto_frontier
from planner.testing.synthetic_graphs import residual_graph
from planner.validate import MAX_PROBLEMS, validate_graph
from tests.api.service_helpers import small_graph

GRAPH = small_graph()


def _replace_node(graph: ActivationGraph, index: int, **changes: object) -> ActivationGraph:
    nodes = list(graph.nodes)
    nodes[index] = dataclasses.replace(nodes[index], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _fields(error: pytest.ExceptionInfo[InvalidGraph]) -> list[str]:
    return [problem.field for problem in error.value.problems]


@pytest.mark.parametrize(("node_count", "per_block"), [(21, 5), (22, 5), (500, 10), (11, 10), (3, 2)])
def test_synthetic_graphs_have_the_asked_size_and_are_valid(node_count: int, per_block: int) -> None:
    graph = residual_graph(node_count=node_count, nodes_per_block=per_block)
    assert len(graph.nodes) == node_count
    validate_graph(graph, max_nodes=node_count)


def test_synthetic_graph_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="nodes_per_block must be at least 2"):
        residual_graph(node_count=10, nodes_per_block=1)
    with pytest.raises(ValueError, match="too small"):
        residual_graph(node_count=5, nodes_per_block=10)


@pytest.mark.parametrize(
    ("graph", "field", "words"),
    [
        (_replace_node(GRAPH, 3, inputs=(GRAPH.nodes[3].name,)), "nodes[3].inputs", "cycle"),
        (_replace_node(GRAPH, 3, inputs=(GRAPH.nodes[6].name,)), "nodes[", "cycle"),
        (_replace_node(GRAPH, 3, reads=("nowhere",)), "nodes[3].reads", "storage_bytes does not list"),
        (_replace_node(GRAPH, 3, saves=(GRAPH.nodes[7].creates[0],)), "nodes[3].saves", "before node"),
        (_replace_node(GRAPH, 3, creates=GRAPH.nodes[2].creates), "nodes[3].creates", "one creator"),
        (_replace_node(GRAPH, 3, name=GRAPH.nodes[2].name), "nodes[3].name", "repeats"),
        (
            _replace_node(GRAPH, 3, replayed_when_kept=GRAPH.nodes[2].creates),
            "nodes[3].replayed_when_kept",
            "does not create it",
        ),
        (_replace_node(GRAPH, 3, backward_workspace_bytes=-1), "nodes[3].backward_workspace_bytes", "-1"),
        (_replace_node(GRAPH, 3, replay_stop_bytes=-1), "nodes[3].replay_stop_bytes", "-1"),
        (_replace_node(GRAPH, 3, forward_ms=math.inf), "nodes[3].forward_ms", "inf"),
        (
            dataclasses.replace(GRAPH, static=dataclasses.replace(GRAPH.static, input_bytes=-2)),
            "static.input_bytes",
            "-2",
        ),
        (dataclasses.replace(GRAPH, nodes=()), "nodes", "no nodes"),
    ],
)
def test_each_kind_of_invalid_graph_names_its_field(graph: ActivationGraph, field: str, words: str) -> None:
    with pytest.raises(InvalidGraph) as caught:
        validate_graph(graph)
    matching = [problem for problem in caught.value.problems if problem.field.startswith(field)]
    assert matching and words in matching[0].message, caught.value.problems
    assert matching[0].field in str(caught.value), "the message lists the field"


def test_too_many_nodes_and_many_problems_are_reported_briefly() -> None:
    with pytest.raises(InvalidGraph, match="21 nodes, more than the limit of 20"):
        validate_graph(GRAPH, max_nodes=20)
    broken = dataclasses.replace(GRAPH, storage_bytes={})
    with pytest.raises(InvalidGraph) as caught:
        validate_graph(broken)
    assert len(caught.value.problems) == MAX_PROBLEMS


def test_frontier_budgets_span_lowest_peak_to_baseline() -> None:
    assert frontier_budgets(100, 200, points=3) == [100, 150, 200]
    assert frontier_budgets(100, 100, points=5) == [100]
    assert frontier_budgets(100, 200, points=1) == [200]
    with pytest.raises(ValueError, match="points must be at least 1, got 0"):
        frontier_budgets(100, 200, points=0)


def test_the_frontier_trades_recompute_for_memory() -> None:
    frontier = pareto_frontier(GRAPH, points=5, solver="dp")
    assert frontier.min_peak_bytes < frontier.baseline_peak_bytes
    recompute = []
    for point in frontier.points:
        assert point.simulation is not None and point.simulation.peak_bytes <= point.budget_bytes
        recompute.append(point.simulation.recompute_ms)
    assert recompute == sorted(recompute, reverse=True) and recompute[-1] == 0.0
    below = pareto_frontier(GRAPH, budgets_bytes=[frontier.min_peak_bytes - 1], solver="dp")
    assert below.points[0].schedule is None and below.points[0].simulation is None
