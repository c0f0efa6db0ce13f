"""`planner.profile`: one profiled step that optimize, pareto, replan and the module level all plan from."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import planner
from planner.ir import GLUE_OP, MemoryCounting
from planner.planning.graph import plan_graph
from planner.profiler.records import Meters
from planner.testing.steps import assert_same_step, one_step
from planner.testing.zoo_real import build_call
from planner.zoo import build_model


@pytest.fixture(scope="module")
def mlp_profile() -> planner.Profile:
    model, inputs = build_model("seed000_mlp")
    return planner.profile(model, inputs, optimizer="adam")


def _middle(profile: planner.Profile) -> int:
    frontier = profile.pareto(points=2, solver="dp")
    return (frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2


def test_one_profile_plans_any_budget_with_the_same_graph(mlp_profile: planner.Profile) -> None:
    budget = _middle(mlp_profile)
    generous = mlp_profile.plan(budget_gb=1)
    tight = mlp_profile.plan(budget_bytes=budget, solver="dp")
    assert generous.graph is tight.graph is mlp_profile.graph, "no second profiling run"
    assert generous.schedule.checkpointed == () and tight.schedule.checkpointed
    assert tight.profile is mlp_profile and tight.module is not None
    assert tight.replan(budget_gb=1).schedule == generous.schedule
    inputs = mlp_profile.example_args
    assert_same_step(one_step(mlp_profile.model, inputs), one_step(tight.module, inputs))


def test_optimize_is_profile_then_plan(mlp_profile: planner.Profile) -> None:
    budget = _middle(mlp_profile)
    model, inputs = mlp_profile.model, mlp_profile.example_args
    plan = planner.optimize(model, inputs, budget_bytes=budget, solver="dp")
    assert plan.profile is not None and plan.profile.settings == mlp_profile.settings
    # Measured node times differ between profiling runs; the memory of the graph does not.
    assert plan.graph.storage_bytes == mlp_profile.graph.storage_bytes
    assert plan.graph.static == mlp_profile.graph.static


def test_a_plan_solved_elsewhere_is_applied_to_its_profile(mlp_profile: planner.Profile) -> None:
    budget = _middle(mlp_profile)
    solved = plan_graph(mlp_profile.graph, budget_bytes=budget, solver="dp")
    loaded = planner.Plan.from_json(solved.to_json())
    assert loaded.module is None
    applied = mlp_profile.apply(loaded)
    assert applied.module is not None and applied.schedule == solved.schedule
    other_model, other_inputs = build_model("seed002_cifar10")
    other = planner.profile(other_model, other_inputs, cost_model="analytic", device="cpu")
    with pytest.raises(ValueError, match="another graph"):
        other.apply(loaded)


def test_pareto_of_a_profile_spans_lowest_to_baseline(mlp_profile: planner.Profile) -> None:
    frontier = mlp_profile.pareto(points=3, solver="dp")
    peaks = [peak for peak, _ in frontier.peaks_and_overheads()]
    assert peaks[0] == frontier.min_peak_bytes and peaks[-1] == frontier.baseline_peak_bytes


def test_the_module_level_goes_through_the_same_object() -> None:
    call = build_call("branching_root")
    profile = planner.profile(call.model, call.args)
    assert profile.capture is None and profile.graph.capture == "module"
    plan = profile.plan(budget_bytes=_middle(profile), solver="dp")
    assert plan.regions and plan.module is not None
    assert plan.replan(budget_gb=1).schedule.checkpointed == ()
    assert_same_step(one_step(call.model, call.args), one_step(plan.module, call.args))


def test_a_unit_measures_what_its_replay_frees_early(mlp_profile: planner.Profile) -> None:
    """NOTE [replay's early frees]: checkpoint frees a replayed tensor once the backward formula is done
    with it, so a checkpointed Linear's input goes before its bias gradient is made. In the block
    `branching_root` runs first (its call split at its children: NOTE [nested units] in
    planner/profiler/split_calls.py), each Linear's input is made inside the block, so it is a
    replay's copy when the block is checkpointed: each Linear's backward peaks lower by its bias
    gradient. A graph of single operators is profiled once and has no such figure."""
    call = build_call("branching_root")
    profile = planner.profile(call.model, call.args)
    first = next(node for node in profile.graph.nodes if node.part_of and node.op != GLUE_OP)
    linears = [node for node in profile.graph.nodes if node.part_of == first.part_of and node.op == "Linear"]
    assert len(linears) == 2, linears
    for linear in linears:
        bias = call.model.get_submodule(linear.module_path).bias
        assert linear.replay_release_bytes == MemoryCounting.BLOCKS.of(bias.nbytes), linear
    assert not any(node.replay_release_bytes for node in mlp_profile.graph.nodes)


def test_bad_arguments_fail_before_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = build_model("seed000_mlp")

    def no_profiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled before checking the arguments")

    monkeypatch.setattr("planner.one_call.profile", no_profiling)
    with pytest.raises(ValueError, match="solver='magic'"):
        planner.optimize(model, inputs, budget_gb=1, solver="magic")
    with pytest.raises(ValueError, match="exactly one of budget_gb"):
        planner.optimize(model, inputs)
    with pytest.raises(TypeError, match="TrainingStep"):
        planner.profile(model, inputs, step=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        planner.profile(model, inputs, world_size=0)


def test_profile_and_Profile_stay_public_after_their_module_loads() -> None:
    import planner.planning.model  # noqa: F401

    assert callable(planner.profile) and planner.profile.__module__ == "planner.planning.model"
    assert isinstance(planner.Profile, type)


def test_a_cuda_workspace_no_tensor_holds_counts_in_the_node_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [library workspaces]: what the CUDA allocator's peak rose by beyond the storages the tracker
    saw is workspace. The allocator is stood in for here (no GPU in CI); test_gpu.py's convolutional
    model checks it against a real one."""
    import torch

    from planner.ir import MemoryCounting
    from planner.profiler.records import ProfilingTracker

    stats = {"allocated_bytes.all.current": 10_240, "allocated_bytes.all.peak": 10_240}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    tracker = ProfilingTracker()
    tracker.counting = MemoryCounting.BLOCKS
    assert tracker.library_workspace_bytes() == 0  # off CUDA: nothing to read
    tracker.cuda_device = torch.device("cuda", 0)
    tracker.reset_peak()
    with tracker:
        output = torch.empty(1000)  # 4,000 bytes: one 4,096-byte block as the allocator counts it
    stats["allocated_bytes.all.peak"] = 10_240 + 4_096 + 1_048_576  # and a 1 MiB workspace, freed
    assert tracker.library_workspace_bytes() == 1_048_576
    stats["allocated_bytes.all.peak"] = 10_240 + 4_096
    assert tracker.library_workspace_bytes() == 0
    del output


class _Halves(torch.autograd.Function):
    """Runs a layer on one half of its input inside its own forward, as Reformer's reversible layers do:
    the half is a view made without grad of a tensor that requires grad, so it has no grad_fn."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        first, second = torch.chunk(hidden, 2, dim=-1)
        ctx.layer = layer
        ctx.save_for_backward(hidden)
        return torch.cat([layer(first), second], dim=-1)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (hidden,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = hidden.detach().requires_grad_()
            first, second = torch.chunk(leaf, 2, dim=-1)
            torch.cat([ctx.layer(first), second], dim=-1).backward(gradient)  # the layer's too
        return leaf.grad, None


class _ReversibleLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layer = nn.Linear(16, 16)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_Halves.apply(self.embed(x), self.layer))


def test_flops_are_counted_where_a_module_gets_a_tensor_that_requires_grad_without_a_grad_fn() -> None:
    """NOTE [global FLOPs] in planner/profiler/records.py: profiling Reformer crashed inside torch's
    `FlopCounterMode` (its module tracker asserts on such a tensor); the planner counts FLOPs without it."""
    meters = Meters(counting=True)
    layer, x = nn.Linear(4, 4), torch.randn(2, 8, requires_grad=True) * 1.0
    with meters, torch.no_grad():
        first, _ = torch.chunk(x, 2, dim=-1)
        layer(first)
    assert meters.flops is not None and meters.flops.get_total_flops() == 2 * 2 * 4 * 4
    torch.manual_seed(0)
    plan = planner.optimize(_ReversibleLike(), (torch.randn(8, 16),), budget_gb=1)
    assert plan.capture == "module", plan.capture
