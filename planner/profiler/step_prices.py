"""The profiling step's prices for the whole device: which cost model times the nodes, what
checkpoint's own work costs a region, and what a selective policy costs an operator.

Why it exists: each is measured on the device of the model's tensors, or, under the analytic cost model
(a model on the meta device, a card not at hand), taken from the device spec; the profiling step
(interpreter.py) asks for all three the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from planner.ir import CostModel
from planner.profiler.cost_model import DeviceSpec, device_spec
from planner.profiler.counting import tensors_in
from planner.profiler.selective_cost import (
    CheckpointCost,
    measure_checkpoint_cost,
    measure_selective_op_overhead_ms,
)

__all__ = ["checkpoint_cost", "cost_spec", "device_of", "selective_op_overhead_ms"]


def cost_spec(
    model: torch.nn.Module, inputs: tuple[Any, ...], cost_model: CostModel, device: str | DeviceSpec | None
) -> DeviceSpec | None:
    """The device spec of the analytic cost model, or None to measure times."""
    on_meta = any(t.is_meta for t in [*model.parameters(), *tensors_in(inputs)])
    if cost_model is CostModel.MEASURED:
        if on_meta:
            raise ValueError(
                "a model on the meta device cannot be timed; pass cost_model='analytic' and the "
                "device to plan for, e.g. device='h100'"
            )
        return None
    if device is None:
        raise ValueError("cost_model='analytic' needs device= (one of 'h100', 'a100', 'cpu' or a DeviceSpec)")
    return device_spec(device)


def device_of(model: torch.nn.Module, inputs: tuple[Any, ...]) -> torch.device:
    tensors = [*model.parameters(), *tensors_in(inputs)]
    return tensors[0].device if tensors else torch.device("cpu")


def checkpoint_cost(
    model: torch.nn.Module, inputs: tuple[Any, ...], spec: DeviceSpec | None
) -> CheckpointCost:
    """The spec's estimates for analytic times, else measured on the device of the model's tensors."""
    if spec is not None:
        return CheckpointCost(call_ms=spec.checkpoint_call_ms, per_operator_ms=spec.checkpoint_op_ms)
    return measure_checkpoint_cost(device_of(model, inputs))


def selective_op_overhead_ms(
    model: torch.nn.Module, inputs: tuple[Any, ...], spec: DeviceSpec | None
) -> float:
    """The spec's estimate for analytic times, else measured on the device of the model's tensors."""
    if spec is not None:
        return spec.selective_op_overhead_ms
    return measure_selective_op_overhead_ms(device_of(model, inputs))
