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
