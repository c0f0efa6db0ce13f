"""Hand-made schedules (the zoo's seed000, seed001, seed003 reports) on synthetic chains: their shapes and
their peaks."""

from __future__ import annotations

import dataclasses

import pytest

from planner.ir import RegionPolicy, Schedule
from planner.planning.plan import Plan
from planner.report.blocks import main_container, numbered_containers
from planner.report.hand_checkpoints import (
    baselines,
    compare,
    each_block,
    each_node,
    equal_segments,
    render_comparison,
    whole_model,
)
from planner.simulation.step import simulate
from planner.testing.synthetic_graphs import chain_graph

GRAPH = chain_graph([8] * 12)
BODY = len(GRAPH.nodes) - 1  # the loss node after the model cannot be checkpointed


def spans(schedule: Schedule) -> list[tuple[int, int, str]]:
    return [(region.start, region.stop, region.policy.value) for region in schedule.regions]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 12, 40])
def test_equal_segments_tile_the_model_and_store_the_last_segment_and_the_loss(count: int) -> None:
    schedule = equal_segments(GRAPH, count)
    simulate(GRAPH, schedule)  # validates the tiling
    checkpointed = schedule.checkpointed
    assert len(checkpointed) == min(count, BODY) - 1
    assert all(region.stop <= BODY for region in checkpointed)
    sizes = {region.stop - region.start for region in checkpointed}
    assert not sizes or max(sizes) - min(sizes) <= 1, sizes
    assert schedule.regions[-1].policy is RegionPolicy.STORE and schedule.regions[-1].stop == len(GRAPH.nodes)


def test_each_node_and_whole_model_shapes() -> None:
    assert spans(each_node(GRAPH)) == [(i, i + 1, "checkpoint") for i in range(BODY)] + [
        (BODY, BODY + 1, "store")
    ]
    assert spans(whole_model(GRAPH)) == [(0, BODY, "checkpoint"), (BODY, BODY + 1, "store")]
    with pytest.raises(ValueError, match="positive number of segments, got 0"):
        equal_segments(GRAPH, 0)


def test_more_segments_have_a_sweet_spot_and_single_ops_or_the_whole_model_save_nothing() -> None:
    peaks = {count: simulate(GRAPH, equal_segments(GRAPH, count)).peak_bytes for count in (1, 2, 4, 12)}
    baseline = peaks[1]
    assert peaks[4] < peaks[2] < baseline, peaks  # seed 000: more segments help ...
    assert peaks[12] > peaks[4], peaks  # ... up to a point, then memory goes up again
    assert simulate(GRAPH, each_node(GRAPH)).peak_bytes >= baseline  # seed 001
    assert simulate(GRAPH, whole_model(GRAPH)).peak_bytes >= baseline  # seed 003


def test_comparison_rows_are_the_simulated_figures() -> None:
    schedules = {"none": equal_segments(GRAPH, 1), "four": equal_segments(GRAPH, 4)}
    rows = compare(GRAPH, schedules)
    for row, schedule in zip(rows, schedules.values(), strict=True):
        result = simulate(GRAPH, schedule)
        assert (row.peak_bytes, row.peak_phase, row.overhead) == (
            result.peak_bytes,
            result.peak_phase,
            result.overhead,
        )
    table = render_comparison(rows, baseline_bytes=rows[0].peak_bytes).splitlines()
    assert table[0].split()[:3] == ["schedule", "regions", "predicted"]
    assert table[2].startswith("four") and "(-" in table[2]


def blocks_graph():  # type: ignore[no-untyped-def]
    """Three blocks of two module ops each, then a residual addition that saves nothing; then the loss."""
    graph = chain_graph([8] * 9)
    nodes = []
    for index, node in enumerate(graph.nodes[:-1]):
        block, position = divmod(index, 3)
        if position == 2:
            nodes.append(dataclasses.replace(node, module_path="", saves=(), saves_anything=False))
        else:
            nodes.append(dataclasses.replace(node, module_path=f"blocks.{block}.op{position}"))
    return dataclasses.replace(graph, nodes=(*nodes, graph.nodes[-1]))


def test_each_block_takes_the_trailing_functional_ops_and_equals_hugging_face() -> None:
    graph = blocks_graph()
    schedule = each_block(graph, "blocks")
    assert spans(schedule) == [
        (0, 3, "checkpoint"),
        (3, 6, "checkpoint"),
        (6, 9, "checkpoint"),
        (9, 10, "store"),
    ]
    plan = Plan(graph=graph, schedule=schedule, budget_bytes=2**40, min_peak_bytes=0)
    assert plan.to_hf_kwargs() == {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert (
        "for block in self.blocks:\n    x = checkpoint(block, x, use_reentrant=False)"
        in plan.to_torch_snippet()
    )
    assert numbered_containers(graph) == ["blocks"]
    with pytest.raises(ValueError, match=r"no numbered children of 'layers'.*\['blocks'\]"):
        each_block(graph, "layers")


def test_baselines_name_the_block_stack_only_when_blocks_repeat() -> None:
    graph = blocks_graph()
    assert main_container(graph) == "blocks"
    schedules = baselines(graph)
    assert list(schedules) == [
        "no checkpointing",
        "sqrt(n) segments (3, checkpoint_sequential)",
        "every block of blocks (Hugging Face)",
    ]
    assert schedules["no checkpointing"].checkpointed == ()
    assert main_container(GRAPH) is None  # chain_graph's layers.k are single operations
    assert len(baselines(GRAPH)) == 2
