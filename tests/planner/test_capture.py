"""Capture: FX first, opaque submodules when FX cannot trace them, a clear error otherwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import planner
from planner.capture.chain import capture
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
