"""Region costs shared across repeated structure (`region_costs.RegionCosts`) equal `region_cost` itself."""

from __future__ import annotations

import random

import pytest

from planner.ir import ActivationGraph
from planner.solvers.chain import Chain, build_chain, region_cost
from planner.solvers.dp import region_costs, tabulate
from planner.solvers.region_costs import RegionCosts
from planner.testing.synthetic_graphs import random_chain, residual_graph, saved_before_made

GRAPHS = {
    "residual, every block drawn": lambda: residual_graph(node_count=301, nodes_per_block=6),
    "residual, one block repeated": lambda: residual_graph(
        node_count=301, nodes_per_block=6, distinct_blocks=1
    ),
    "residual, three blocks cycling": lambda: residual_graph(
        node_count=301, nodes_per_block=6, distinct_blocks=3
    ),
    "random chain": lambda: random_chain(random.Random(4), 11),
    "residual, saving what later nodes make": lambda: saved_before_made(
        residual_graph(node_count=301, nodes_per_block=6, distinct_blocks=3), random.Random(5)
    ),
}


@pytest.mark.parametrize("name", GRAPHS)
def test_every_tabulated_summary_equals_region_cost(name: str) -> None:
    graph: ActivationGraph = GRAPHS[name]()
    chain = build_chain(graph)
    costs = region_costs(chain)
    table = tabulate(costs)
    assert table
    for transitions in table.transitions.values():
        for transition in transitions:
            region, (summary,) = transition.region, transition.variants
            held_in = transition.source[1]
            cost = region_cost(chain, region, held_in=held_in)
            assert (summary.peak_bytes, summary.charged_bytes) == (cost.peak_bytes, cost.charged_bytes)
            assert summary.recompute_ms == pytest.approx(cost.recompute_ms, rel=1e-12, abs=1e-12)
            assert transition.target == (region.stop, cost.held_out)
            assert costs.cost(region, held_in=held_in) == cost


def distinct_regions(chain: Chain) -> tuple[int, int]:
    """(region structures costed, transitions tabulated) when tabulating `chain`."""
    costs = RegionCosts(chain, max_region_nodes=len(chain.graph.nodes))
    table = tabulate(region_costs(chain))
    entries = 0
    for (_, held_in), transitions in table.transitions.items():
        for transition in transitions:
            costs.summary(transition.region, held_in=held_in)
            entries += 1
    return costs.distinct_regions, entries


def test_repeated_blocks_are_costed_once_per_region_shape() -> None:
    repeated = build_chain(residual_graph(node_count=2001, distinct_blocks=1))
    drawn = build_chain(residual_graph(node_count=2001))
    assert repeated.boundaries == drawn.boundaries
    repeated_costed, entries = distinct_regions(repeated)
    drawn_costed, drawn_entries = distinct_regions(drawn)
    assert drawn_entries == entries
    assert repeated_costed < drawn_costed // 10


def test_repeated_blocks_repeat_sizes_and_times() -> None:
    graph = residual_graph(node_count=31, nodes_per_block=5, distinct_blocks=2)
    shape = [
        (node.op, node.forward_ms, [graph.storage_bytes[name] for name in node.creates])
        for node in graph.nodes
    ]
    assert shape[0:5] == shape[10:15] != shape[5:10] == shape[15:20]
