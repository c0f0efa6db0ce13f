"""Helpers shared by the torch-side tests: one training step's loss, gradients and buffers."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from planner.measurement import default_loss


@dataclass
class StepResult:
    loss: torch.Tensor
    gradients: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def one_step(module: torch.nn.Module, inputs: tuple[Any, ...], *, seed: int = 1234) -> StepResult:
    """Forward and backward on a copy of `module` under a fixed seed (dropout masks repeat)."""
    module = copy.deepcopy(module)
    inputs = tuple(
        t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in inputs
    )
    torch.manual_seed(seed)
    loss = default_loss(module(*inputs))
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
    gradients.update(
        {
            f"input{i}": t.grad.detach().clone()
            for i, t in enumerate(inputs)
            if isinstance(t, torch.Tensor) and t.grad is not None
        }
    )
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return StepResult(loss=loss.detach(), gradients=gradients, buffers=buffers)


def assert_same_step(expected: StepResult, actual: StepResult, *, rtol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.loss, expected.loss, rtol=rtol, atol=0.0)
    assert actual.gradients.keys() == expected.gradients.keys(), "the same parameters must receive gradients"
    for name, gradient in expected.gradients.items():
        scale = gradient.abs().max().item() or 1.0
        torch.testing.assert_close(
            actual.gradients[name], gradient, rtol=rtol, atol=rtol * scale, msg=f"gradient of {name}"
        )
    assert actual.buffers.keys() == expected.buffers.keys()
    for name, buffer in expected.buffers.items():
        torch.testing.assert_close(actual.buffers[name], buffer, rtol=0.0, atol=0.0, msg=f"buffer {name}")
