"""Predicted reserved memory: a schedule's allocations run through the caching allocator model.

Why it exists: the simulator predicts the bytes live tensors hold (`max_memory_allocated`), but a GPU
runs out of memory when CUDA's caching allocator cannot *reserve* more (allocator.py). What a plan
reserves depends on the order and sizes of its allocations, not only on their sum at the peak, so
this replays the order the simulator walks (`simulate(..., log=...)`) through the allocator model:
the default allocator and `expandable_segments:True`, side by side. Nothing here imports torch; the
service predicts reserved memory for a posted graph too. Solving under a reserved budget calls the
solvers, so it is theirs (solvers/reserved_budget.py).

NOTE [allocation order]: what the simulator knows, allocated in its order, for two steady-state
steps (the first step fills the allocator's cache, the second runs on it):
- Static state once, before the first step: parameters, buffers, inputs and optimizer state, each as
  one allocation per component (the graph keeps their sums, not each tensor's size), and with
  accumulation the resident gradients.
- Each activation storage as itself, allocated where it is made and freed where the schedule frees
  it; a replay's storages as their own allocations.
- A node's measured workspace as one allocation made and freed at the node, its parameter gradients
  as one allocation from its backward to the end of the step, and the gradients in flight while a
  replay runs as one allocation around the replay.
Workspaces and gradients are made of several tensors on a GPU; one allocation each is the
approximation, and it places them in the large pool where their parts might share small segments.
`make gpu-check` (bench/gpu_check.py) measures `max_memory_reserved` against this prediction.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.ir import ActivationGraph, Schedule
from planner.simulation.allocation_log import REPLAY_SUFFIX, AllocationLog
from planner.simulation.allocator import AllocatorEvent, AllocatorSettings, CachingAllocatorModel, replay
from planner.simulation.step import simulate, storage_sizes

__all__ = [
    "ReservedPrediction",
    "allocation_events",
    "memory_snapshot",
    "predict_reserved",
    "reserved_peak_bytes",
    "write_snapshot",
]

STEADY_STEPS = 2
"""Steps replayed: the first fills the allocator's cache, the second runs on it (NOTE [allocation order])."""


def allocation_events(
    graph: ActivationGraph, schedule: Schedule, *, steps: int = STEADY_STEPS
) -> list[AllocatorEvent]:
    """The allocations and frees of `steps` training steps under `schedule` (NOTE [allocation order])."""
    log = AllocationLog(storage_sizes(graph))
    static = graph.static
    resident = {
        "#parameters": static.parameter_bytes,
        "#buffers": static.buffer_bytes,
        "#inputs": static.input_bytes,
        "#optimizer-state": static.optimizer_state_bytes,
        "#resident-gradients": static.resident_gradient_bytes,
    }
    for name, size_bytes in resident.items():
        log.malloc(name, size_bytes)
    kept = frozenset(log.live)
    for _ in range(steps):
        simulate(graph, schedule, log=log)
        log.free_all(keep=kept)
    return log.events


@dataclass(frozen=True)
class ReservedPrediction:
    """Predicted peaks of a schedule as CUDA's caching allocator would report them."""

    allocated_peak_bytes: int
    """`max_memory_allocated`: the blocks handed out, each rounded and, where its segment's remainder was
    too small to split, whole (NOTE [unsplit blocks] in simulation/allocator.py)."""
    reserved_peak_bytes: int
    """`max_memory_reserved` with the default allocator: what the device must hold."""
    expandable_reserved_peak_bytes: int
    """`max_memory_reserved` with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`."""

    @property
    def expandable_saving_bytes(self) -> int:
        """What expandable segments would save of the reserved peak."""
        return self.reserved_peak_bytes - self.expandable_reserved_peak_bytes


def predict_reserved(
    graph: ActivationGraph, schedule: Schedule, settings: AllocatorSettings | None = None
) -> ReservedPrediction:
    """Reserved (and allocated) peaks of `schedule` under `settings` (PyTorch's defaults) and under
    expandable segments, on a device with room for all of it."""
    events = allocation_events(graph, schedule)
    chosen = settings or AllocatorSettings()
    default = replay(events, chosen)
    expandable = replay(events, dataclasses.replace(chosen, expandable_segments=True))
    return ReservedPrediction(
        allocated_peak_bytes=default.peak_allocated_bytes,
        reserved_peak_bytes=default.peak_reserved_bytes,
        expandable_reserved_peak_bytes=expandable.peak_reserved_bytes,
    )


def reserved_peak_bytes(graph: ActivationGraph, schedule: Schedule, settings: AllocatorSettings) -> int:
    """The reserved peak of `schedule` under `settings`."""
    return replay(allocation_events(graph, schedule), settings).peak_reserved_bytes


def memory_snapshot(
    graph: ActivationGraph, schedule: Schedule, settings: AllocatorSettings | None = None
) -> dict[str, Any]:
    """The predicted step (two steady-state steps, NOTE [allocation order]) as `torch.cuda.memory._snapshot()`
    writes it: the allocator model's segments and its trace, each allocation named by its storage, the
    node that makes it and that node's module, for pytorch.org/memory_viz (pickle it to a file)."""
    model = CachingAllocatorModel(settings or AllocatorSettings(), record_trace=True)
    label = _labeller(graph)
    for event in allocation_events(graph, schedule):
        match event:
            case ("malloc", name, size_bytes):
                model.malloc(label(name), size_bytes)
            case ("free", name):
                model.free(label(name))
    return model.snapshot()


def write_snapshot(snapshot: Mapping[str, Any], path: str | Path) -> Path:
    """Pickle `snapshot` to `path`, as `torch.cuda.memory._dump_snapshot` does; returns the path."""
    target = Path(path)
    with target.open("wb") as file:
        pickle.dump(dict(snapshot), file)
    return target


def _labeller(graph: ActivationGraph) -> Any:
    """A function naming an allocation of `allocation_events` in the model's words."""
    modules = {node.name: node.module_path for node in graph.nodes}
    made_by = {storage: node.name for node in graph.nodes for storage in node.creates}

    def label(name: str) -> str:
        base = name.split("#")[0].removesuffix(REPLAY_SUFFIX)
        node = made_by.get(base, base)
        if node not in modules:
            return name
        made = f"made by {node}" if base in made_by else "of"
        return f"{name} {made} ({modules[node] or 'the root module'})"

    return label
