"""What the tests of compiled plans share: the seed, a budget no plan reaches, the gradient tolerance,
and one step's loss and gradients (test_compiled.py, test_compiled_breaks.py)."""

from __future__ import annotations

from typing import Any

import torch

from planner.testing.steps import seeded_gradients

GRADIENT_RTOL = 1e-4
"""Inductor fuses differently around a recomputed region: sums in another order, float32 rounding."""
SEED = 1234
HUGE_BUDGET_BYTES = 2**40


def compiled_gradients(
    module: torch.nn.Module, parameters: Any, inputs: tuple[Any, ...]
) -> tuple[torch.Tensor, ...]:
    """Loss and every gradient (flattened, parameters then inputs) of one step under `SEED`."""
    targets = [*parameters, *(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)]
    return seeded_gradients(module, targets, inputs, seed=SEED)
