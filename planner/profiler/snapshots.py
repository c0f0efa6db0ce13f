"""Memory snapshots of a plan's training step, in the format pytorch.org/memory_viz reads.

Why it exists: people already read GPU memory in PyTorch's own viewer, from the dict
`torch.cuda.memory._snapshot()` returns, pickled to a file. A plan's predicted step (its allocations in
the simulator's order, through the caching allocator model: `reserved.memory_snapshot`) and a measured
one written in that format open side by side there, segment by segment and allocation by allocation.

The measured snapshot is the real one on a GPU (`torch.cuda.memory._record_memory_history`); on the CPU,
which has no caching allocator, it is the measured order of the step's tensor allocations
(`measurement.record_allocations`) run through the same allocator model, so that the two snapshots
differ only where the prediction's order or sizes differ from the step's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from planner.ir import TrainingStep
from planner.profiler.counting import tensors_in
from planner.profiler.measurement import OptimizerSpec, measure_step, record_allocations
from planner.simulation.allocator import AllocatorSettings, CachingAllocatorModel, apply_event

__all__ = ["measured_snapshot"]

MAX_TRACE_ENTRIES = 200_000
"""Allocations and frees `torch.cuda.memory._record_memory_history` keeps (its default is 100,000)."""


def measured_snapshot(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: OptimizerSpec,
    step: TrainingStep,
    settings: AllocatorSettings | None = None,
) -> dict[str, Any]:
    """Two real training steps of a copy of `model` as a memory snapshot (see the module docstring)."""
    trained = copy.deepcopy(model)
    device = next(iter(tensors_in((tuple(trained.parameters()), inputs, dict(kwargs)))), None)
    if device is not None and device.device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=MAX_TRACE_ENTRIES)
        try:
            measure_step(
                trained, inputs, example_kwargs=kwargs, loss_fn=loss_fn, optimizer=optimizer, step=step
            )
            return dict(torch.cuda.memory._snapshot())
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    events = record_allocations(
        trained, inputs, example_kwargs=kwargs, loss_fn=loss_fn, optimizer=optimizer, step=step
    )
    allocator = CachingAllocatorModel(settings or AllocatorSettings(), record_trace=True)
    for event in events:
        apply_event(allocator, event)
    return allocator.snapshot()
