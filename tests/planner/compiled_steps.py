"""What the tests of compiled plans share: the seed, a budget no plan reaches, the gradient tolerance,
and one step's loss and gradients (test_compiled.py, test_compiled_breaks.py)."""

from __future__ import annotations

from typing import Any

import torch

from planner.profiler.measurement import default_loss

GRADIENT_RTOL = 1e-4
"""Inductor fuses differently around a recomputed region: sums in another order, float32 rounding."""
SEED = 1234
HUGE_BUDGET_BYTES = 2**40


def compiled_gradients(
    module: torch.nn.Module, parameters: Any, inputs: tuple[Any, ...]
) -> tuple[torch.Tensor, ...]:
    """Loss and every gradient (flattened, parameters then inputs) of one step under `SEED`."""
    torch.manual_seed(SEED)
    loss = default_loss(module(*inputs))
    targets = [*parameters, *(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)]
    gradients = torch.autograd.grad(loss, targets)
    return loss.detach(), torch.cat([g.flatten() for g in gradients])
