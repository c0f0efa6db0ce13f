"""The simulator on hand-built graphs whose timelines are worked out by hand in the comments."""

from __future__ import annotations

import dataclasses

import pytest

from planner.ir import ActivationGraph, Phase, Region, RegionPolicy, Schedule, SimulationResult
from planner.serialize import graph_from_dict, graph_to_dict, schedule_from_dict, schedule_to_dict
from planner.simulation.allocator import replay
from planner.simulation.replay import checkpoint_overhead_ms
from planner.simulation.reserved import allocation_events
from planner.simulation.step import simulate, store_everything
from planner.solvers.chain import build_chain, region_cost
from planner.testing.synthetic_graphs import MIB, chain_graph, with_selective_price

STATIC_MIB = 4 + 1 + 8  # parameters + inputs + Adam state of `chain_graph`


def one_region(graph: ActivationGraph, start: int, stop: int) -> Schedule:
    """Nodes start..stop-1 checkpointed, the rest stored."""
    return Schedule(
        regions=(
            Region(0, start, RegionPolicy.STORE),
            Region(start, stop, RegionPolicy.CHECKPOINT),
            Region(stop, len(graph.nodes), RegionPolicy.STORE),
        ),
        solver="test",
    )


def test_store_everything_peaks_at_first_backward_node_with_saved_inputs() -> None:
    graph = chain_graph([2, 2, 2])
    result = simulate(graph, store_everything(graph))
    # Backward of n2: s0 and s1 retained (4), its measured residual (2), gradients of n2 (0.25).
    assert result.peak_bytes == int((STATIC_MIB + 4 + 2 + 0.25) * MIB)
    assert result.peak_phase is Phase.BACKWARD and result.peak_node == "n2"
    assert result.recompute_ms == 0.0
    forward = [step for step in result.trace if step.phase is Phase.FORWARD]
    assert [step.live_bytes - STATIC_MIB * MIB for step in forward] == [2 * MIB, 4 * MIB, 6 * MIB, 6 * MIB]


def test_checkpointing_two_nodes_replays_up_to_the_trigger_and_can_raise_the_peak() -> None:
    """Seed 000's surprise: a region too small frees little and its replay costs more."""
    graph = chain_graph([2, 2, 2])
    nodes = list(graph.nodes)
    nodes[1] = dataclasses.replace(nodes[1], forward_workspace_bytes=8 * MIB)
    nodes[3] = dataclasses.replace(nodes[3], backward_workspace_bytes=2 * MIB)  # the loss's gradient
    graph = dataclasses.replace(graph, nodes=tuple(nodes))
    result = simulate(graph, one_region(graph, 1, 3))
    # Without checkpointing the peak is n1's forward: s0 (2) + s1 (2) + its workspace (8).
    assert simulate(graph, store_everything(graph)).peak_bytes == int((STATIC_MIB + 12) * MIB)
    # Replay at n2: s0 retained (2) + n1 replayed, s1 (2) and its workspace (8), beside the gradient in
    # flight from the loss to n2 (2); n2 saves only s1, so the replay stops before making s2 (NOTE
    # [early stop]).
    assert result.peak_phase is Phase.RECOMPUTE and result.peak_node == "n2"
    assert result.peak_bytes == int((STATIC_MIB + 2 + 2 + 8 + 2) * MIB)
    # Only n1's forward runs again (1 ms): the replay stops before n2's operator runs.
    assert result.recompute_ms == pytest.approx(1.0)


def test_a_checkpointed_region_that_saves_nothing_holds_nothing() -> None:
    """NOTE [regions that save nothing]: n1 saves nothing for backward (a mask made from tensors that
    need no grad), so checkpoint keeps no frame for it, its input s0 goes after its forward as without
    checkpointing, and nothing is replayed: the step is the same as storing everything."""
    graph = chain_graph([2, 2, 2])
    nodes = list(graph.nodes)
    nodes[1] = dataclasses.replace(nodes[1], saves=(), saves_anything=False)
    graph = dataclasses.replace(graph, nodes=tuple(nodes))
    schedule = one_region(graph, 1, 2)
    stored = simulate(graph, store_everything(graph))
    checkpointed = simulate(graph, schedule)
    assert [step.live_bytes for step in checkpointed.trace] == [step.live_bytes for step in stored.trace]
    assert checkpointed.peak_bytes == stored.peak_bytes
    assert checkpointed.recompute_ms == pytest.approx(checkpoint_overhead_ms(graph, schedule.regions[1]))
    chain = build_chain(graph)
    assert region_cost(chain, schedule.regions[1], held_in=frozenset()).charged_bytes == 0


def test_a_region_that_keeps_pays_the_selective_policy_on_each_of_its_operators() -> None:
    graph = chain_graph([2, 2, 2])
    priced = with_selective_price(graph, [3] * len(graph.nodes), 0.1)

    def recompute_ms(of: ActivationGraph, keep: tuple[int, ...]) -> float:
        regions = (
            Region(0, 1, RegionPolicy.STORE),
            Region(1, 3, RegionPolicy.CHECKPOINT, keep),
            Region(3, 4, RegionPolicy.STORE),
        )
        return simulate(of, Schedule(regions=regions, solver="test")).recompute_ms

    # n1 replays; n2 ends the replay before its operator runs (NOTE [early stop]).
    assert recompute_ms(priced, ()) == recompute_ms(graph, ()) == pytest.approx(1.0)
    # Two nodes of three operators each, forward and replay under the policy.
    assert recompute_ms(priced, (1,)) == pytest.approx(recompute_ms(graph, (1,)) + 0.1 * 6)


def test_two_checkpointed_regions_lower_the_peak() -> None:
    graph = chain_graph([1, 4, 4, 4, 4, 1])
    schedule = Schedule(
        regions=(
            Region(0, 1, RegionPolicy.STORE),
            Region(1, 3, RegionPolicy.CHECKPOINT),
            Region(3, 5, RegionPolicy.CHECKPOINT),
            Region(5, 7, RegionPolicy.STORE),
        ),
        solver="test",
    )
    # Baseline: backward of n5 holds s0..s4 (17) + residual 1 + gradients 0.25.
    assert simulate(graph, store_everything(graph)).peak_bytes == int((STATIC_MIB + 18.25) * MIB)
    # Backward of n4: s0, s2 kept (5) + s3 replayed (4; the replay stopped before s4) + residual 4 +
    # gradients of n4 and n5 (0.5).
    result = simulate(graph, schedule)
    assert result.peak_bytes == int((STATIC_MIB + 13.5) * MIB)
    assert (result.peak_phase, result.peak_node) == (Phase.BACKWARD, "n4")


def test_optimizer_step_can_set_the_peak() -> None:
    graph = chain_graph([1, 1])
    heavy = dataclasses.replace(graph.static, optimizer_step_workspace_bytes=64 * MIB)
    result = simulate(dataclasses.replace(graph, static=heavy), store_everything(graph))
    assert result.peak_phase is Phase.OPTIMIZER
    assert result.peak_bytes == (4 + 1 + 8 + 4 + 64) * MIB


@pytest.mark.parametrize(
    "regions",
    [
        (Region(0, 2, RegionPolicy.STORE),),
        (Region(0, 2, RegionPolicy.STORE), Region(3, 4, RegionPolicy.STORE)),
        (Region(0, 3, RegionPolicy.STORE), Region(3, 4, RegionPolicy.CHECKPOINT)),
    ],
    ids=["short", "gap", "checkpointed-loss"],
)
def test_invalid_schedules_are_rejected(regions: tuple[Region, ...]) -> None:
    graph = chain_graph([1, 1, 1])
    with pytest.raises(AssertionError):
        simulate(graph, Schedule(regions=regions, solver="test"))


def test_graph_and_schedule_round_trip_through_json_form() -> None:
    graph = with_selective_price(chain_graph([3, 1, 2]), [2, 1, 3, 1], 0.02)
    schedule = Schedule(
        regions=(Region(0, 2, RegionPolicy.CHECKPOINT, (1,)), Region(2, 4, RegionPolicy.STORE)),
        solver="ilp",
        gap=0.01,
    )
    assert graph_from_dict(graph_to_dict(graph)) == graph
    assert schedule_from_dict(schedule_to_dict(schedule)) == schedule


def test_unknown_schema_version_is_rejected_with_the_version_found() -> None:
    data = graph_to_dict(chain_graph([1]))
    data["schema"] = "planner.graph/v0"
    with pytest.raises(ValueError, match="planner.graph/v0"):
        graph_from_dict(data)


def test_a_compiled_backward_frees_what_it_read_before_its_largest_buffer() -> None:
    """NOTE [early release]: n2's backward first reads s1 (a weight gradient), then holds 2 MiB (the input
    gradient). Where s1 leaves at n2, the 2 MiB moment does not also hold s1; where an earlier node
    holds s1 longer (n1 saves it too), it does."""
    graph = chain_graph([2, 2, 2])
    nodes = list(graph.nodes)
    nodes[2] = dataclasses.replace(nodes[2], backward_points=((1 * MIB, ()), (2 * MIB, ("s1",))))
    freed = dataclasses.replace(graph, nodes=tuple(nodes))
    nodes[1] = dataclasses.replace(nodes[1], saves=("s0", "s1"))
    held = dataclasses.replace(graph, nodes=tuple(nodes))

    def at_n2(of: ActivationGraph) -> int:
        result = simulate(of, store_everything(of))
        return next(s.live_bytes for s in result.trace if s.phase is Phase.BACKWARD and s.node == "n2")

    gradients = int(0.25 * MIB)
    # s0 and s1 pending (4) + max(1 - 0, 2 - 2) = 1 while s1 goes; + max(1, 2) = 2 while n1 keeps it.
    assert at_n2(freed) == (STATIC_MIB + 4 + 1) * MIB + gradients
    assert at_n2(held) == (STATIC_MIB + 4 + 2) * MIB + gradients
    assert graph_from_dict(graph_to_dict(freed)) == freed


def test_a_compiled_backward_frees_what_its_replay_made_before_its_largest_buffer() -> None:
    """NOTE [early release] holds for replayed storages too: a compiled backward recomputes s1 just
    before n2's weight gradient reads it and frees it after, before n2's 2 MiB input gradient. (Seed
    003's compiled lowest peak was predicted 7 MiB high, 83.15 against 76.16 MiB, and planned there.)"""
    graph = chain_graph([2, 2, 2])
    nodes = list(graph.nodes)
    nodes[2] = dataclasses.replace(nodes[2], backward_points=((1 * MIB, ()), (2 * MIB, ("s1",))))
    graph = dataclasses.replace(graph, nodes=tuple(nodes))
    schedule = Schedule(
        regions=(
            Region(0, 1, RegionPolicy.STORE),
            Region(1, 3, RegionPolicy.CHECKPOINT),
            Region(3, 4, RegionPolicy.STORE),
        ),
        solver="test",
    )
    result = simulate(graph, schedule)
    at_n2 = next(s.live_bytes for s in result.trace if s.phase is Phase.BACKWARD and s.node == "n2")
    # s0 held for the replay (2) + s1 replayed (2) + max(1 - 0, 2 - 2) = 1 + n2's gradients (0.25).
    assert at_n2 == (STATIC_MIB + 4 + 1) * MIB + MIB // 4
    points = region_cost(build_chain(graph), schedule.regions[1], held_in=frozenset()).points_bytes
    assert at_n2 - STATIC_MIB * MIB in points, "the solvers cost the region as the simulator replays it"


def test_a_backward_whose_saves_are_all_replayed_peaks_lower_by_what_checkpoint_frees_early() -> None:
    """NOTE [replay's early frees] (profiler/calibration.py): n2's backward peaks 1 MiB lower where s1,
    all it saves, is a replay's copy, which checkpoint frees once n2's backward formula is done with it.
    Checkpointed alone, n2 saves its region's input, which checkpoint holds: no lower. The solvers cost
    the region as the simulator replays it."""
    graph = chain_graph([2, 2, 2])
    nodes = list(graph.nodes)
    nodes[2] = dataclasses.replace(nodes[2], replay_release_bytes=1 * MIB)
    graph = dataclasses.replace(graph, nodes=tuple(nodes))

    def regions(first: int) -> tuple[Region, ...]:
        return (
            Region(0, first, RegionPolicy.STORE),
            Region(first, 3, RegionPolicy.CHECKPOINT),
            Region(3, 4, RegionPolicy.STORE),
        )

    def at_n2(first: int) -> int:
        result = simulate(graph, Schedule(regions=regions(first), solver="test"))
        return next(s.live_bytes for s in result.trace if s.phase is Phase.BACKWARD and s.node == "n2")

    gradients = MIB // 4
    # s0 held for the replay (2) + s1 replayed (2) + n2's residual (2) less 1 + n2's gradients.
    assert at_n2(first=1) == (STATIC_MIB + 4 + 1) * MIB + gradients
    points = region_cost(build_chain(graph), regions(first=1)[1], held_in=frozenset()).points_bytes
    assert at_n2(first=1) - STATIC_MIB * MIB in points, "the solvers cost the region as the simulator does"
    # s0 saved by n1 (2) + s1 held as the region's input (2) + n2's whole residual (2) + n2's gradients.
    assert at_n2(first=2) == (STATIC_MIB + 6) * MIB + gradients
    stored = simulate(graph, store_everything(graph))
    assert stored.peak_bytes == simulate(chain_graph([2, 2, 2]), store_everything(graph)).peak_bytes
    assert graph_from_dict(graph_to_dict(graph)) == graph


def _opaque_block(**changes: object) -> ActivationGraph:
    """chain_graph([2, 2, 2]) whose n1 is a block of many operators: it also makes and saves a 12 MiB
    `inner` tensor, and makes 20 MiB of parameter gradients, so its backward sets the peak."""
    graph = chain_graph([2, 2, 2])
    nodes = list(graph.nodes)
    nodes[0] = dataclasses.replace(nodes[0], backward_workspace_bytes=0)
    nodes[1] = dataclasses.replace(
        nodes[1],
        creates=("s1", "inner"),
        saves=("s0", "inner"),
        parameter_gradient_bytes=20 * MIB,
        **changes,  # type: ignore[arg-type]
    )
    # Every gradient the allocation log makes is a node's; the optimizer step holds them all.
    gradient_bytes = sum(node.parameter_gradient_bytes for node in nodes)
    static = dataclasses.replace(graph.static, gradient_bytes=gradient_bytes)
    storage_bytes = {**graph.storage_bytes, "inner": 12 * MIB}
    return dataclasses.replace(graph, nodes=tuple(nodes), storage_bytes=storage_bytes, static=static)


def test_an_eager_block_that_frees_its_saves_part_way_is_predicted_so_and_logged_exactly() -> None:
    """NOTE [freed part way in eager backward] (profiler/calibration.py, issue 35): n1's backward peaks at
    1 MiB above what was live before its saves (s0, inner: 14 MiB), which it frees as it goes. The
    prediction is that peak, not the saves held through it, and the allocation log frees them before the
    workspace rather than skip a negative one: its live bytes peak where the simulator's do."""
    graph = _opaque_block(backward_points=((1 * MIB, ("s0", "inner")),))
    schedule = store_everything(graph)
    result = simulate(graph, schedule)

    def at_n1(result: SimulationResult) -> int:
        return next(s.live_bytes for s in result.trace if s.phase is Phase.BACKWARD and s.node == "n1")

    gradients = 20 * MIB + MIB // 4
    assert at_n1(result) == STATIC_MIB * MIB + gradients + 1 * MIB
    assert replay(allocation_events(graph, schedule)).peak_requested_bytes == result.peak_bytes
    held = simulate(_opaque_block(), schedule)
    assert at_n1(held) == at_n1(result) - 1 * MIB + 14 * MIB + 2 * MIB, "s0, inner and its residual"
    assert held.peak_bytes == at_n1(held) > result.peak_bytes
    assert graph_from_dict(graph_to_dict(graph)) == graph


def test_a_replay_stops_at_the_last_save_of_a_block_of_many_operators() -> None:
    """NOTE [early stop]: n1 saves `inner` before it makes its 2 MiB output, so a replay of it holds
    `inner` (its measured peak up to that save, `replay_stop_bytes`), not its whole forward; the solvers
    cost the region so, and the allocation log adds up to the simulated peak."""
    schedule = Schedule(
        regions=(
            Region(0, 1, RegionPolicy.STORE),
            Region(1, 2, RegionPolicy.CHECKPOINT),
            Region(2, 4, RegionPolicy.STORE),
        ),
        solver="test",
    )

    def replay_bytes(graph: ActivationGraph) -> int:
        result = simulate(graph, schedule)
        assert replay(allocation_events(graph, schedule)).peak_requested_bytes == result.peak_bytes
        return next(s.live_bytes for s in result.trace if s.phase is Phase.RECOMPUTE and s.node == "n1")

    stopped = _opaque_block(replay_stop_bytes=12 * MIB)
    assert replay_bytes(stopped) == replay_bytes(_opaque_block()) - 2 * MIB
    assert graph_from_dict(graph_to_dict(stopped)) == stopped
    costs = [
        region_cost(build_chain(graph), schedule.regions[1], held_in=frozenset()).points_bytes
        for graph in (stopped, _opaque_block())
    ]
    forward, at_replay, backward = (after - before for before, after in zip(*costs, strict=True))
    assert (forward, at_replay, backward) == (0, 2 * MIB, 0), (
        "the solvers cost the replay as the simulator does"
    )
    times = [simulate(graph, schedule).recompute_ms for graph in (stopped, _opaque_block())]
    assert times[0] == times[1] > checkpoint_overhead_ms(stopped, schedule.regions[1]), (
        "the operators up to the last save run again: the node's forward is charged whole"
    )
    assert (
        region_cost(build_chain(stopped), schedule.regions[1], held_in=frozenset()).recompute_ms == times[0]
    )
