"""The analytic cost model and planning on the meta device (a model this machine never allocates)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import planner
from planner.profiler.cost_model import DEVICES, DeviceSpec, analytic_forward_ms, device_spec
from planner.profiler.records import moved_bytes
from planner.zoo import build_model


def test_roofline_takes_the_slower_of_compute_and_memory() -> None:
    spec = DeviceSpec("toy", flops_per_s=1e12, memory_bytes_per_s=1e9, overhead_ms=0.0)
    assert analytic_forward_ms(10**12, 0, spec) == pytest.approx(1000.0)
    assert analytic_forward_ms(0, 10**9, spec) == pytest.approx(1000.0)
    assert analytic_forward_ms(10**12, 2 * 10**9, spec) == pytest.approx(2000.0)


def test_unknown_devices_and_bad_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="'tpu'.*a100"):
        device_spec("tpu")
    with pytest.raises(ValueError, match="positive rates"):
        device_spec(DeviceSpec("broken", flops_per_s=0, memory_bytes_per_s=1, overhead_ms=0))
    assert device_spec("h100") is DEVICES["h100"]


def test_analytic_times_follow_flops_and_a_faster_device_is_faster() -> None:
    model, inputs = build_model("gpt_tiny")
    on_cpu = planner.optimize(model, inputs, budget_bytes=2**40, cost_model="analytic", device="cpu")
    on_h100 = planner.optimize(model, inputs, budget_bytes=2**40, cost_model="analytic", device="h100")
    assert on_h100.simulation.step_ms < on_cpu.simulation.step_ms
    heaviest = max(on_cpu.graph.nodes, key=lambda node: node.forward_flops)
    lightest = min(
        (node for node in on_cpu.graph.nodes if node.moved_bytes),
        key=lambda node: node.forward_flops + node.moved_bytes,
    )
    assert heaviest.forward_flops > 0 and heaviest.forward_ms > lightest.forward_ms
    assert all(node.backward_ms == pytest.approx(2 * node.forward_ms) for node in on_cpu.graph.nodes)
    assert on_h100.graph.timing == "analytic (h100)"
    assert "per-node times analytic (h100)" in on_h100.summary()
    assert planner.Plan.from_json(on_h100.to_json()).graph.timing == "analytic (h100)"


def test_operators_are_counted_and_the_selective_overhead_is_measured_or_estimated() -> None:
    model, inputs = build_model("seed000_mlp")
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    measured = planner.Plan.from_json(plan.to_json()).graph
    analytic = planner.optimize(model, inputs, budget_bytes=2**40, cost_model="analytic", device="a100").graph
    # Linear dispatches a transpose and an addmm, ReLU one operator.
    assert [(node.op, node.operator_count) for node in measured.nodes[:2]] == [("Linear", 2), ("ReLU", 1)]
    assert 0 < measured.selective_op_overhead_ms == plan.graph.selective_op_overhead_ms < 1
    assert analytic.selective_op_overhead_ms == DEVICES["a100"].selective_op_overhead_ms


@pytest.mark.parametrize("name", ["gpt_tiny", "seed000_mlp"])
def test_meta_device_plans_match_plans_of_the_real_model(name: str) -> None:
    """Allocated budgets: the graphs and their plans are compared, not the allocator (planned for an H100,
    a budget would bound reserved memory by default)."""
    model, inputs = build_model(name)
    options: dict[str, Any] = {"cost_model": "analytic", "device": "h100", "budget_kind": "allocated"}
    real = planner.optimize(model, inputs, budget_bytes=2**40, **options)
    with torch.device("meta"):
        meta_model, meta_inputs = build_model(name)
    assert next(meta_model.parameters()).is_meta
    meta = planner.optimize(meta_model, meta_inputs, budget_bytes=2**40, **options)
    assert meta.graph.storage_bytes == real.graph.storage_bytes
    assert [n.operator_count for n in meta.graph.nodes] == [n.operator_count for n in real.graph.nodes]
    assert meta.baseline_peak_bytes == real.baseline_peak_bytes
    assert meta.min_peak_bytes == real.min_peak_bytes
    budget = (real.min_peak_bytes + real.baseline_peak_bytes) // 2
    assert (
        planner.optimize(meta_model, meta_inputs, budget_bytes=budget, **options).schedule
        == planner.optimize(model, inputs, budget_bytes=budget, **options).schedule
    )


def test_meta_models_need_the_analytic_cost_model() -> None:
    with torch.device("meta"):
        model, inputs = build_model("seed000_mlp")
    with pytest.raises(ValueError, match="cost_model='analytic'"):
        planner.optimize(model, inputs, budget_gb=1)
    with pytest.raises(ValueError, match="cost_model='fast'"):
        planner.optimize(model, inputs, budget_gb=1, cost_model="fast")
    with pytest.raises(ValueError, match="needs device="):
        planner.optimize(model, inputs, budget_gb=1, cost_model="analytic")


def test_pareto_frontier_from_one_profile_falls_and_plots(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, inputs = build_model("seed000_mlp")
    frontier = planner.pareto(model, inputs, points=4, solver="dp", cost_model="analytic", device="cpu")
    pairs = frontier.peaks_and_overheads()
    assert len(pairs) == 4
    assert pairs[0][0] == frontier.min_peak_bytes and pairs[-1] == (frontier.baseline_peak_bytes, 0.0)
    overheads = [overhead for _, overhead in pairs]
    assert overheads == sorted(overheads, reverse=True)
    picture = frontier.plot(tmp_path / "pareto.png")
    assert picture.stat().st_size > 1000


def test_a_view_moves_no_bytes_and_a_copy_moves_what_it_reads_and_writes() -> None:
    x = torch.zeros(4, 8, device="meta")
    assert moved_bytes((x,), x.transpose(0, 1)) == 0
    assert moved_bytes((x,), (x.unflatten(1, (2, 4)), x[0])) == 0
    assert moved_bytes((x,), x.transpose(0, 1).contiguous()) == 2 * x.numel() * x.element_size()
    assert moved_bytes((x,), (x.view(32), x + 1)) == x.numel() * x.element_size() * 3


def test_random_operators_write_at_the_random_number_rate() -> None:
    cpu = DEVICES["cpu"]
    assert cpu.random_bytes_per_s is not None
    drawn_ms = analytic_forward_ms(0, 10**9, cpu, random=True) - cpu.overhead_ms
    streamed_ms = analytic_forward_ms(0, 10**9, cpu) - cpu.overhead_ms
    assert drawn_ms == pytest.approx(streamed_ms * cpu.memory_bytes_per_s / cpu.random_bytes_per_s)
    h100 = DEVICES["h100"]
    assert analytic_forward_ms(0, 10**9, h100, random=True) == analytic_forward_ms(0, 10**9, h100)


def test_cards_named_with_their_memory_carry_what_the_driver_reports() -> None:
    assert device_spec("h100-80gb").memory_bytes == 85_017_493_504  # measured on the lent H100
    assert device_spec("a100-40gb").memory_bytes == 42_298_834_944  # an A100-SXM4-40GB's deviceQuery
    nominal_gib = {"h100-80gb": 80, "a100-40gb": 40, "a100-80gb": 80, "l40s": 48, "rtx4090": 24}
    for name, gib in nominal_gib.items():
        memory_bytes = device_spec(name).memory_bytes
        assert memory_bytes is not None and 0.98 * gib * 2**30 < memory_bytes < gib * 2**30, name
    assert device_spec("a100").memory_bytes is None  # 40 or 80 GiB: the name does not say
    with pytest.raises(ValueError, match="memory_bytes must be positive"):
        device_spec(DeviceSpec("broken", flops_per_s=1, memory_bytes_per_s=1, overhead_ms=0, memory_bytes=0))
