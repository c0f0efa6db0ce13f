"""The budget as a GPU counts it: 512-byte blocks, reserved memory, what a card holds back.

The model here is not in any zoo: a small convolution net of odd sizes with GroupNorm
(planner/testing/odd_sizes.py), whose many small tensors make the allocator's rounding matter, as it did
for the diffusion U-Net that measured 0.7 % over a budget counted in exact bytes.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest

import planner
from planner.ir import BLOCK_BYTES, BudgetKind, MemoryCounting
from planner.profiler.cost_model import device_spec
from planner.serialize import graph_from_dict, graph_to_dict
from planner.simulation.allocator import AllocatorSettings, replay
from planner.simulation.reserved import allocation_events, predict_reserved
from planner.testing.odd_sizes import odd_net
from planner.zoo import build_model


def test_every_storage_of_a_graph_counted_in_blocks_is_whole_blocks() -> None:
    model, inputs = odd_net()
    blocks = planner.profile(model, inputs).graph
    exact = planner.profile(model, inputs, memory_counting="exact").graph
    assert blocks.memory_counting is MemoryCounting.BLOCKS and exact.memory_counting is MemoryCounting.EXACT
    assert all(size >= BLOCK_BYTES and size % BLOCK_BYTES == 0 for size in blocks.storage_bytes.values())
    assert any(size % BLOCK_BYTES for size in exact.storage_bytes.values())
    assert blocks.static.parameter_bytes > exact.static.parameter_bytes


def test_a_plan_in_exact_bytes_overruns_as_a_gpu_counts_and_a_plan_in_blocks_does_not() -> None:
    """The issue's finding, on a model not built for it: an exact-bytes plan at its lowest peak is exact
    in exact bytes and over its budget in blocks; the default plan at its own lowest peak fits in blocks."""
    model, inputs = odd_net()
    exact_reference = planner.optimize(model, inputs, budget_bytes=2**40, memory_counting="exact")
    exact_budget = exact_reference.min_peak_bytes
    exact_plan = planner.optimize(model, inputs, budget_bytes=exact_budget, memory_counting="exact")
    measured = planner.measure(copy.deepcopy(exact_plan.module), inputs)
    assert measured.exact_peak_bytes <= exact_budget
    assert measured.peak_bytes > exact_budget, "in 512-byte blocks the exact plan is over its budget"

    lowest = planner.optimize(model, inputs, budget_bytes=2**40).min_peak_bytes
    assert lowest > exact_budget
    plan = planner.optimize(model, inputs, budget_bytes=lowest)
    measured = planner.measure(copy.deepcopy(plan.module), inputs)
    assert measured.peak_bytes <= lowest
    assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 1024
    with pytest.raises(planner.InfeasibleBudget):
        planner.optimize(model, inputs, budget_bytes=lowest - 1)


def test_a_graph_keeps_its_counting_through_json_and_older_documents_count_exact_bytes() -> None:
    model, inputs = odd_net()
    graph = planner.profile(model, inputs).graph
    assert graph_from_dict(graph_to_dict(graph)) == graph
    older = graph_to_dict(graph)
    del older["memory_counting"]
    assert graph_from_dict(older).memory_counting is MemoryCounting.EXACT
    with pytest.raises(ValueError, match="memory_counting='pages' is not known"):
        graph_from_dict({**older, "memory_counting": "pages"})
    with pytest.raises(ValueError, match="memory_counting='kib' is not known"):
        planner.profile(model, inputs, memory_counting="kib")


@pytest.mark.parametrize("lightning_order", [False, True])
@pytest.mark.parametrize("name", ["seed003_feedforward", "gpt_tiny", "cnn_bn_dropout"])
def test_the_allocation_log_adds_up_to_the_simulated_peak_and_the_allocator_never_reserves_less(
    name: str, lightning_order: bool
) -> None:
    """The order the allocator model replays is the simulator's own: its live bytes peak exactly where
    the simulator's do, at every budget, also with gradients alive through the forward alone (NOTE
    [loop orders]); reserved >= allocated >= that peak."""
    model, inputs = build_model(name)
    step = planner.TrainingStep(zero_grad_before_backward=lightning_order)
    profiled = planner.profile(model, inputs, cost_model="analytic", device="cpu", step=step)
    reference = profiled.plan(budget_bytes=2**40)
    for fraction in (0.0, 0.4, 1.0):
        span = reference.baseline_peak_bytes - reference.min_peak_bytes
        budget = int(reference.min_peak_bytes + fraction * span)
        plan = profiled.plan(budget_bytes=budget, budget_kind="allocated")
        peaks = replay(allocation_events(plan.graph, plan.schedule))
        assert peaks.peak_requested_bytes == plan.predicted_peak_bytes
        assert peaks.peak_reserved_bytes >= peaks.peak_allocated_bytes >= plan.predicted_peak_bytes
        reserved = predict_reserved(plan.graph, plan.schedule)
        assert reserved.reserved_peak_bytes == peaks.peak_reserved_bytes
        assert reserved.expandable_reserved_peak_bytes >= reserved.allocated_peak_bytes


def test_a_reserved_budget_is_kept_as_the_allocator_would_reserve_it() -> None:
    model, inputs = build_model("seed003_feedforward")
    profiled = planner.profile(model, inputs, cost_model="analytic", device="cpu")
    assert profiled.default_budget_kind is BudgetKind.ALLOCATED  # the CPU has no caching allocator
    baseline = profiled.plan(budget_bytes=2**40, budget_kind="reserved")
    assert baseline.budget_kind is BudgetKind.RESERVED
    lowest_reserved = baseline.min_peak_bytes
    assert lowest_reserved >= profiled.plan(budget_bytes=2**40).min_peak_bytes
    budget = (lowest_reserved + baseline.reserved.reserved_peak_bytes) // 2
    plan = profiled.plan(budget_bytes=budget, budget_kind="reserved")
    assert plan.reserved.reserved_peak_bytes <= budget
    assert "the budget bounds               reserved memory" in plan.summary()
    with pytest.raises(planner.InfeasibleBudget, match="That is the reserved peak") as caught:
        profiled.plan(budget_bytes=lowest_reserved - 1, budget_kind="reserved")
    assert caught.value.min_peak_bytes == lowest_reserved
    with pytest.raises(ValueError, match="budget_kind='committed' is not known"):
        profiled.plan(budget_bytes=budget, budget_kind="committed")
    exact = planner.profile(model, inputs, cost_model="analytic", device="cpu", memory_counting="exact")
    with pytest.raises(ValueError, match="counts exact bytes"):
        exact.plan(budget_bytes=budget, budget_kind="reserved")


def test_a_budget_for_a_named_gpu_is_its_memory_less_what_it_holds_back() -> None:
    spec = device_spec("h100-80gb")
    assert spec.held_back_bytes == 2**30 + 2 * 32 * 2**20  # the context allowance and two cuBLAS workspaces
    model, inputs = build_model("seed000_mlp")
    plan = planner.optimize(model, inputs, cost_model="analytic", device="h100-80gb")
    assert plan.budget_bytes == spec.usable_memory_bytes == 85_017_493_504 - spec.held_back_bytes
    assert plan.card == "h100-80gb" and plan.held_back_bytes == spec.held_back_bytes
    assert plan.budget_kind is BudgetKind.ALLOCATED  # measured within 0.73 % on an H100; reserved is not yet
    assert "held back for the CUDA context and cuBLAS workspaces" in plan.summary()
    restored = planner.Plan.from_json(plan.to_json())
    assert (restored.card, restored.held_back_bytes, restored.budget_kind) == (
        plan.card,
        plan.held_back_bytes,
        plan.budget_kind,
    )
    assert device_spec("a100-40gb").library_workspace_bytes == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)


def test_a_replan_bounds_what_its_plan_bounded() -> None:
    """On a GPU the default budget is reserved memory; a plan asked for in allocated bytes (what
    `max_memory_allocated` reports, as bench.compare's peers are measured) must stay so when replanned.
    The first bench.compare on an H100 replanned at a peer's allocated peak as reserved bytes and called
    every budget "below our predicted min"."""
    model, inputs = build_model("seed000_mlp")
    allocated = planner.optimize(
        model, inputs, cost_model="analytic", device="h100-80gb", budget_bytes=2**40, budget_kind="allocated"
    )
    budget = (allocated.min_peak_bytes + allocated.baseline_peak_bytes) // 2
    replanned = allocated.replan(budget_bytes=budget, solver="dp")
    assert replanned.budget_kind is BudgetKind.ALLOCATED
    assert replanned.predicted_peak_bytes <= budget
    reserved = allocated.replan(budget_bytes=2**40, budget_kind="reserved")
    assert reserved.budget_kind is BudgetKind.RESERVED
    assert reserved.replan(budget_bytes=2**40).budget_kind is BudgetKind.RESERVED


def test_capacity_on_a_card_plans_against_what_the_card_leaves() -> None:
    table = planner.capacity(
        lambda batch: build_model("seed000_mlp", batch=batch), batch=[2, 4, 8], device="rtx4090"
    )
    spec = device_spec("rtx4090")
    assert table.budget_bytes == spec.usable_memory_bytes and table.held_back_bytes == spec.held_back_bytes
    assert "held back for the CUDA context and cuBLAS workspaces" in str(table)
    assert json.loads(json.dumps(table.to_dict()))["held_back_bytes"] == spec.held_back_bytes


def test_the_predicted_and_measured_steps_open_in_pytorchs_memory_viewer(tmp_path: Path) -> None:
    from torch.cuda import _memory_viz

    model, inputs = odd_net()
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    predicted = pickle.loads(plan.export_memory_snapshot(tmp_path / "predicted.pickle").read_bytes())
    written = plan.export_memory_snapshot(tmp_path / "measured.pickle", measured=True)
    measured = pickle.loads(written.read_bytes())
    for snapshot in (predicted, measured):
        assert "total_reserved" in _memory_viz.segsum(snapshot)  # segsum checks the segments add up
        assert "<html>" in _memory_viz.trace_plot(snapshot)
    assert any("made by" in name and "blocks." in name for name in _frame_names(predicted))
    assert any(name.startswith("convolution#") for name in _frame_names(measured))


def _frame_names(snapshot: dict) -> set[str]:
    entries = [entry for trace in snapshot["device_traces"] for entry in trace]
    return {frame["name"] for entry in entries for frame in entry["frames"]}


def test_a_reserved_plan_says_when_expandable_segments_would_let_a_cheaper_plan_fit() -> None:
    model, inputs = build_model("seed003_feedforward")
    profiled = planner.profile(model, inputs, cost_model="analytic", device="cpu")
    budget = 150 * 2**20  # between the default allocator's and expandable segments' reserved peaks
    plan = profiled.plan(budget_bytes=budget, budget_kind="reserved")
    expandable = profiled.plan(
        budget_bytes=budget, budget_kind="reserved", allocator=AllocatorSettings(expandable_segments=True)
    )
    assert expandable.reserved.expandable_reserved_peak_bytes <= budget
    assert expandable.predicted_overhead < plan.predicted_overhead
    assert f"a plan recomputing {expandable.predicted_overhead:.1%} of the step fits" in plan.allocator_note
    assert "expandable_segments:True" in plan.summary()
    assert expandable.allocator_note == ""
