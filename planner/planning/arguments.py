"""The checks of the user's arguments, shared by every way in: `profile`, `optimize`, `pareto`,
`capacity` and the service client.

Why it exists: each public call takes the same budget, example call, training step, sharding, cost
model, memory counting and allocator settings, and a bad one must fail the same way wherever it is
given (what was wrong, the value, what to do), before any profiling run. String options are turned
into the enums of ir.py here, once; everything below the public calls takes the enums.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from planner.errors import GIB, UnsupportedModel
from planner.ir import CostModel, MemoryCounting, Sharding, TrainingStep
from planner.profiler.cost_model import DeviceSpec, device_spec
from planner.profiler.counting import tensors_in
from planner.rewrite.emit import fully_sharded_modules
from planner.simulation.allocator import AllocatorSettings

__all__ = [
    "allocator_settings_of",
    "budget_and_card",
    "budget_bytes_of",
    "cost_model_of",
    "example_call",
    "memory_counting_of",
    "refuse_sharded_model",
    "reshard_after_forward_of",
    "sharding_of",
    "training_step_of",
]


def budget_bytes_of(budget_gb: float | None, budget_bytes: int | None) -> int:
    """The checked budget in bytes: exactly one of `budget_gb` (GiB) or `budget_bytes`, positive."""
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError(
            f"give exactly one of budget_gb (GiB, 2**30 bytes) or budget_bytes; got budget_gb={budget_gb!r}, "
            f"budget_bytes={budget_bytes!r} (optimize also takes a card's memory: device='h100-80gb')"
        )
    if budget_gb is not None:
        if (
            isinstance(budget_gb, bool)
            or not isinstance(budget_gb, int | float)
            or not math.isfinite(budget_gb)
        ):
            raise TypeError(f"budget_gb must be a finite number of GiB, got {budget_gb!r}")
        if budget_gb <= 0:
            raise ValueError(f"budget_gb must be positive, got {budget_gb!r}")
        return int(budget_gb * GIB)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__} {budget_bytes!r}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
    return budget_bytes


def _example_inputs(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, Sequence) and not isinstance(example_inputs, str):
        if not any(isinstance(value, torch.Tensor) for value in example_inputs):
            raise TypeError("example_inputs holds no tensor; pass the tensors the model's forward takes")
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple/list of the forward's positional arguments, "
        f"got {type(example_inputs).__name__}; pass keyword arguments as example_kwargs={{...}}"
    )


def example_call(example_inputs: Any, example_kwargs: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """Positional example inputs, checked; with keyword inputs, positional ones may be empty."""
    if example_kwargs is None:
        return _example_inputs(example_inputs)
    if not isinstance(example_kwargs, Mapping):
        raise TypeError(
            f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}"
        )
    if example_inputs is None or (isinstance(example_inputs, Sequence) and len(example_inputs) == 0):
        if not tensors_in(example_kwargs):
            raise TypeError("example_kwargs holds no tensor; pass the tensors the model's forward takes")
        return ()
    return _example_inputs(example_inputs)


def training_step_of(step: TrainingStep | None) -> TrainingStep:
    """The checked `step` argument: a TrainingStep, or None for one micro-batch."""
    if step is None:
        return TrainingStep()
    if not isinstance(step, TrainingStep):
        raise TypeError(
            f"step must be a planner.TrainingStep, got {type(step).__name__} {step!r}; e.g. "
            "step=planner.TrainingStep(accumulation_steps=4, max_grad_norm=1.0)"
        )
    return step


def refuse_sharded_model(model: torch.nn.Module) -> None:
    """Profiling a model that fully_shard already wraps would plan DTensor shards and run collectives."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sharded = fully_sharded_modules(model)
    if sharded:
        raise UnsupportedModel(
            f"fully_shard (FSDP2) already wraps {sharded[0] or 'the model'!r}: plan the unsharded model. "
            "Call plan = planner.optimize(model, ..., sharding='fsdp') first, then fully_shard each block "
            "of plan.module and plan.module itself."
        )


def sharding_of(world_size: int, sharding: Sharding | str) -> Sharding:
    """The checked `world_size` and `sharding` arguments."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (ranks of data parallelism), got {world_size!r}")
    try:
        return Sharding(sharding)
    except ValueError as error:
        choices = [member.value for member in Sharding]
        raise ValueError(f"sharding={sharding!r} is not known; use one of {choices}") from error


def reshard_after_forward_of(sharding: Sharding, reshard_after_forward: bool) -> bool:
    """The checked `reshard_after_forward` argument: fully_shard's own, so only with sharding='fsdp'."""
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward must be True or False (fully_shard's argument of that name), got "
            f"{type(reshard_after_forward).__name__} {reshard_after_forward!r}"
        )
    if not reshard_after_forward and sharding is not Sharding.FSDP:
        raise ValueError(
            f"reshard_after_forward=False describes fully_shard (FSDP2), but sharding={sharding.value!r}: "
            "use sharding='fsdp', or leave reshard_after_forward at True"
        )
    return reshard_after_forward


def memory_counting_of(memory_counting: MemoryCounting | str) -> MemoryCounting:
    """The checked `memory_counting` argument."""
    try:
        return MemoryCounting(memory_counting)
    except ValueError as error:
        choices = [member.value for member in MemoryCounting]
        raise ValueError(
            f"memory_counting={memory_counting!r} is not known; use one of {choices}: 'blocks' counts each "
            "tensor as CUDA's caching allocator does (the default, right for GPUs), 'exact' its own bytes "
            "(for training on the CPU)"
        ) from error


def cost_model_of(cost_model: CostModel | str) -> CostModel:
    """The checked `cost_model` argument."""
    try:
        return CostModel(cost_model)
    except ValueError as error:
        raise ValueError(f"cost_model={cost_model!r} is not known; use 'measured' or 'analytic'") from error


def allocator_settings_of(allocator_conf: str | None) -> AllocatorSettings:
    """The caching allocator's settings from `allocator_conf`, by default from this process's
    PYTORCH_CUDA_ALLOC_CONF (or its newer name, PYTORCH_ALLOC_CONF)."""
    if allocator_conf is None:
        allocator_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    return AllocatorSettings.from_conf(allocator_conf)


def budget_and_card(
    budget_gb: float | None, budget_bytes: int | None, device: str | DeviceSpec | None
) -> tuple[int, DeviceSpec | None]:
    """The budget given, or without one the usable memory of the card `device` names (its memory less
    what is held back, NOTE [held back] in profiler/cost_model.py) and that card."""
    if budget_gb is None and budget_bytes is None and device is not None:
        spec = device_spec(device)
        if spec.usable_memory_bytes is not None:
            return spec.usable_memory_bytes, spec
    return budget_bytes_of(budget_gb, budget_bytes), None
