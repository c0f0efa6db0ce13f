"""Capture: FX first, opaque submodules when FX cannot trace them, a clear error otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import planner
from planner.capture.chain import capture
from planner.testing.steps import assert_same_step, one_step
from planner.zoo import build_model


class RootBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


def test_traceable_model_takes_the_fx_path() -> None:
    model, _ = build_model("gpt_tiny")
    assert capture(model).path == "fx"


def test_untraceable_submodule_is_kept_opaque_and_planned() -> None:
    model, inputs = build_model("untraceable_mlp")
    captured = capture(model)
    assert captured.opaque_modules and captured.path.startswith("fx (opaque:")
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    # its branch on the input's sign never changes which children it calls (NOTE [split calls])
    assert plan.capture == f"fx (planned by children: {', '.join(captured.opaque_modules)})"


def test_control_flow_in_the_root_forward_names_the_construct() -> None:
    with pytest.raises(planner.UnsupportedModel, match="RootBranches.*torch.where"):
        capture(RootBranches())


class TensorOrNumberStep(nn.Module):
    """Turns a number into a tensor when it is not one, as diffusers' UNets do with the timestep."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
        if not torch.is_tensor(step):
            step = torch.tensor([step])
        return self.linear(x) * step[:, None]


def test_is_tensor_answers_true_for_a_traced_tensor() -> None:
    """NOTE [is_tensor under FX]: without it FX takes the number's branch; here the trace then fails
    and the model falls to torch.export, and on diffusers' UNet2DModel the trace recorded
    `torch.tensor([timestep])` on the input tensor and failed when profiled."""
    model = TensorOrNumberStep()
    inputs = (torch.randn(4, 8), torch.arange(4.0))
    captured = capture(model, inputs)
    assert captured.path == "fx"
    targets = {getattr(node.target, "__name__", "") for node in captured.graph_module.graph.nodes}
    assert "tensor" not in targets, targets
    assert torch.equal(captured.graph_module(*inputs), model(*inputs))
    assert not torch.is_tensor(torch.fx.Proxy.__new__(torch.fx.Proxy)), "restored after tracing"


class ScoresItsTargets(nn.Module):
    """Embeds tokens and scores the next-token logits against targets, as a causal LM called with
    `labels=input_ids` does; a branch on a size keeps FX out, so torch.export captures it."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        if tokens.shape[0] > 4:
            hidden = 2 * hidden
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), targets.flatten())


def test_an_example_passing_one_tensor_twice_captures_two_inputs() -> None:
    """NOTE [aliased example inputs]: planned from `model(ids, ids)`, the module trains on other
    batches whose targets are not their tokens with the model's loss and gradients (before, the graph
    embedded the targets)."""
    torch.manual_seed(0)
    model, tokens = ScoresItsTargets(), torch.randint(32, (8, 12))
    profile = planner.profile(model, (tokens, tokens))
    frontier = profile.pareto(points=2, solver="dp")
    plan = profile.plan(
        budget_bytes=(frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2, solver="dp"
    )
    assert plan.capture == "export" and plan.module is not None and plan.regions
    batch = (torch.randint(32, (8, 12)), torch.randint(32, (8, 12)))
    assert_same_step(one_step(model, batch), one_step(plan.module, batch))
