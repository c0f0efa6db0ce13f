"""Predicted reserved memory: a schedule's allocations run through the caching allocator model.

Why it exists: the simulator predicts the bytes live tensors hold (`max_memory_allocated`), but a GPU
runs out of memory when CUDA's caching allocator cannot *reserve* more (simulation/allocator.py). What a plan
reserves depends on the order and sizes of its allocations, not only on their sum at the peak, so
this replays the order the simulator walks (`simulate(..., log=...)`) through the allocator model:
the default allocator and `expandable_segments:True`, side by side. Nothing here imports torch; the
service predicts reserved memory for a posted graph too.

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

from planner.errors import InfeasibleBudget, format_bytes
from planner.ir import BLOCK_BYTES, ActivationGraph, Schedule
from planner.simulation.allocator import AllocatorEvent, AllocatorSettings, CachingAllocatorModel, replay
from planner.simulation.step import REPLAY_SUFFIX, AllocationLog, simulate, storage_sizes
from planner.solvers import lowest_peak, solve

__all__ = [
    "ReservedPrediction",
    "allocation_events",
    "expandable_note",
    "memory_snapshot",
    "predict_reserved",
    "reserved_peak_bytes",
    "solve_reserved",
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


def _reserved_hint(
    graph: ActivationGraph, schedule: Schedule, settings: AllocatorSettings, budget_bytes: int
) -> str:
    """What an infeasible reserved budget's message adds: the allocated peak the reserved one is made
    of, and whether expandable segments would fit it."""
    allocated = format_bytes(simulate(graph, schedule).peak_bytes)
    hint = f"(That is the reserved peak, predicted: the plan allocates {allocated}."
    if settings.expandable_segments:
        return hint + ")"
    expandable = dataclasses.replace(settings, expandable_segments=True)
    expandable_bytes = reserved_peak_bytes(graph, schedule, expandable)
    if expandable_bytes <= budget_bytes:
        return (
            f"{hint} With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it reserves "
            f"{format_bytes(expandable_bytes)} and fits: set it in the training process's environment "
            "and plan with optimize(..., allocator_conf='expandable_segments:True').)"
        )
    return f"{hint} With expandable segments it reserves {format_bytes(expandable_bytes)}.)"


def reserved_peak_bytes(graph: ActivationGraph, schedule: Schedule, settings: AllocatorSettings) -> int:
    """The reserved peak of `schedule` under `settings`."""
    return replay(allocation_events(graph, schedule), settings).peak_reserved_bytes


MAX_RESERVED_SOLVES = 8
"""Solves a reserved budget tries (NOTE [reserved budgets])."""


def solve_reserved(
    graph: ActivationGraph, *, budget_bytes: int, solver: str, settings: AllocatorSettings
) -> tuple[Schedule, int]:
    """(The schedule with the least recompute found whose predicted reserved peak fits `budget_bytes`,
    the reserved peak of the plan with the lowest allocated peak.)

    NOTE [reserved budgets]: the solvers bound allocated bytes, which they add up region by region;
    reserved bytes depend on the whole order of allocations. So a reserved budget is solved as an
    allocated one, first at the budget itself, then bisecting the allocated budget between the lowest
    allocated peak and the budget, each plan replayed through the allocator model, at most
    MAX_RESERVED_SOLVES solves; the largest allocated budget whose plan reserves within the budget wins.
    The plan with the lowest allocated peak is the fallback, and the measure of infeasibility: where
    even it reserves more than the budget, `InfeasibleBudget` carries its reserved peak. A plan that
    reserves less may exist; this finds the ones the allocated solves lead to.
    """
    lowest_schedule, lowest = lowest_peak(graph)
    lowest_reserved_bytes = reserved_peak_bytes(graph, lowest_schedule, settings)
    if lowest_reserved_bytes > budget_bytes:
        raise InfeasibleBudget(
            budget_bytes=budget_bytes,
            min_peak_bytes=lowest_reserved_bytes,
            breakdown=lowest.breakdown,
            hint=_reserved_hint(graph, lowest_schedule, settings, budget_bytes),
        )
    best, fitting_bytes, over_bytes = lowest_schedule, lowest.peak_bytes, budget_bytes + 1
    target_bytes = budget_bytes
    for _ in range(MAX_RESERVED_SOLVES):
        if target_bytes < lowest.peak_bytes:
            break
        schedule = solve(graph, budget_bytes=target_bytes, solver=solver)
        if reserved_peak_bytes(graph, schedule, settings) <= budget_bytes:
            best, fitting_bytes = schedule, target_bytes
            if target_bytes == budget_bytes:
                break
        else:
            over_bytes = target_bytes
        target_bytes = (fitting_bytes + over_bytes) // 2
        if over_bytes - fitting_bytes <= BLOCK_BYTES:
            break
    return best, lowest_reserved_bytes


def expandable_note(
    graph: ActivationGraph, schedule: Schedule, *, budget_bytes: int, solver: str, settings: AllocatorSettings
) -> str:
    """What a report says when `expandable_segments:True` changes the answer to a reserved budget: the
    recompute of the plan it would let fit, where that is less than `schedule`'s ("" otherwise)."""
    if settings.expandable_segments:
        return ""
    expandable = dataclasses.replace(settings, expandable_segments=True)
    other, _ = solve_reserved(graph, budget_bytes=budget_bytes, solver=solver, settings=expandable)
    ours, theirs = simulate(graph, schedule), simulate(graph, other)
    if theirs.recompute_ms >= ours.recompute_ms:
        return ""
    return (
        f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True a plan recomputing {theirs.overhead:.1%} of "
        f"the step fits this budget (this one: {ours.overhead:.1%}); plan with allocator_conf="
        "'expandable_segments:True' and set it for training"
    )


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
