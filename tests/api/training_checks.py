"""One training step's loss and gradients, to compare a planned module with its original.

A small copy of tests/planner/zoo_checks.py (test directories are not packages, so the service tests
keep their own).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from planner.measurement import default_loss


def step_gradients(
    module: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    seed: int = 1234,
) -> dict[str, torch.Tensor]:
    """Loss and parameter gradients of forward and backward on a copy of `module` under a fixed seed."""
    module = copy.deepcopy(module)
    torch.manual_seed(seed)
    loss = default_loss(module(*inputs, **(kwargs or {})))
    loss.backward()
    gradients = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), **gradients}


def assert_same_gradients(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys(), "the same parameters must receive gradients"
    for name, value in expected.items():
        scale = value.abs().max().item() or 1.0
        torch.testing.assert_close(
            actual[name], value, rtol=1e-6, atol=1e-6 * scale, msg=f"gradient of {name}"
        )
