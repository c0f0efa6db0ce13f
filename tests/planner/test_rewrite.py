"""The checkpointed module is a drop-in: same parameters, same results, none of the known traps."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
from torch import nn

import planner
from planner.capture.chain import capture
from planner.ir import Region, RegionPolicy, Schedule
from planner.profiler.interpreter import build_activation_graph
from planner.profiler.measurement import default_loss
from planner.rewrite.emit import CheckpointedRegion, planned_graph_of, rewrite
from planner.testing.steps import assert_same_step, one_step
from planner.zoo import build_model


def checkpoint_everything(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> nn.Module:
    """Rewrite with every model node in one checkpointed region (the loss node stays stored)."""
    captured = capture(model)
    graph = build_activation_graph(captured, model, inputs, loss_fn=default_loss, optimizer=None)
    count = len(graph.nodes)
    schedule = Schedule(
        regions=(Region(0, count - 1, RegionPolicy.CHECKPOINT), Region(count - 1, count, RegionPolicy.STORE)),
        solver="test",
    )
    return rewrite(model, captured, graph, schedule)


def test_input_without_grad_never_freezes_the_first_weights() -> None:
    """Seed 002's trap: reentrant checkpointing gives the first block no gradient."""
    model, inputs = build_model("seed000_mlp")
    assert not inputs[0].requires_grad
    planned = checkpoint_everything(model, inputs)
    assert any(isinstance(m, CheckpointedRegion) for m in planned_graph_of(planned).modules())
    result = one_step(planned, inputs)
    first_weight = next(name for name, _ in model.named_parameters())
    assert result.gradients[first_weight].abs().sum() > 0
    assert_same_step(one_step(model, inputs), result)


def test_dropout_masks_repeat_in_the_replay() -> None:
    model, inputs = build_model("gpt_tiny")
    assert_same_step(one_step(model, inputs), one_step(checkpoint_everything(model, inputs), inputs))


def test_batchnorm_statistics_are_updated_once() -> None:
    model, inputs = build_model("cnn_bn_dropout")
    planned = checkpoint_everything(model, inputs)
    result = one_step(planned, inputs)
    tracked = [value for name, value in result.buffers.items() if name.endswith("num_batches_tracked")]
    assert tracked and all(value.item() == 1 for value in tracked)
    assert_same_step(one_step(model, inputs), result)


class ScaledBranch(nn.Module):
    """A branch that reads a parameter, written after an independent branch: the shape of DeBERTa's
    disentangled attention, whose replayed region ran its projections out of the graph's order."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((64,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.relu()
        first = hidden.sin() * 2.0
        second = hidden * self.scale
        third = first.cos()
        return first + second + third


CALLS = ("call_function", "call_method", "call_module")


def test_a_checkpointed_region_runs_its_nodes_in_the_graphs_order() -> None:
    """NOTE [region order]: the simulator predicts each region, its replay and its backward in the
    graph's order, so the fused body must run in that order too."""
    model, inputs = ScaledBranch(), (torch.randn(8, 64, requires_grad=True),)
    planned = checkpoint_everything(model, inputs)
    graph_order = [node.name for node in capture(model).graph_module.graph.nodes if node.op in CALLS]
    (region,) = [m for m in planned_graph_of(planned).modules() if isinstance(m, CheckpointedRegion)]
    body_order = [node.name for node in region.body.graph.nodes if node.op in CALLS]
    assert body_order == [name for name in graph_order if name in body_order]
    assert_same_step(one_step(model, inputs), one_step(planned, inputs))


def test_planned_module_is_a_drop_in_for_the_model() -> None:
    model, inputs = build_model("cnn_bn_dropout")
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    planned = plan.module
    assert planned is not None
    assert isinstance(planned, type(model))
    assert [id(p) for p in planned.parameters()] == [id(p) for p in model.parameters()]
    assert planned.state_dict().keys() == model.state_dict().keys()
    planned.eval()
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        torch.testing.assert_close(planned(*inputs), reference(*inputs))


def test_a_planned_module_copies_when_its_example_was_moved_to_the_device() -> None:
    """`x.to("cuda")` of an input that requires grad is no leaf, and a leaf-less tensor cannot be
    deep-copied: the first `make gpu-check` failed so on seed003_feedforward. Here `x * 1` stands in for
    the move; the planned module must hold no example tensor, so its copy trains like the model."""
    model, (leaf,) = build_model("seed003_feedforward")
    moved = leaf * 1
    assert moved.requires_grad and not moved.is_leaf
    plan = planner.optimize(model, (moved,), budget_bytes=2**40, solver="dp")
    assert plan.module is not None
    copied = copy.deepcopy(plan.module)
    assert_same_step(one_step(model, (leaf,)), one_step(copied, (leaf,)))


def test_a_planned_module_keeps_no_example_tensor_alive() -> None:
    """A user who keeps only `plan.module` trains it on other batches: the example batch must be freed
    (its prediction at another shape needs the example's shapes alone), or it stays on the device
    outside every prediction."""
    model, inputs = build_model("gpt_tiny")
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    module = plan.module
    example = weakref.ref(inputs[0])
    del plan, inputs
    gc.collect()
    assert module is not None and example() is None


def test_optimize_leaves_the_model_and_the_rng_as_they_were() -> None:
    model, inputs = build_model("cnn_bn_dropout")
    parameters = copy.deepcopy(model.state_dict())
    rng_state = torch.get_rng_state()
    planner.optimize(model, inputs, budget_bytes=2**40)
    assert torch.equal(torch.get_rng_state(), rng_state)
    for name, value in model.state_dict().items():
        assert torch.equal(value, parameters[name]), f"{name} changed during planning"
    assert all(p.grad is None for p in model.parameters())
