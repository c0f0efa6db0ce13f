"""What-if: the checkpointing people apply by hand, predicted by the same simulator as the plans.

Why it exists: users try `checkpoint_sequential` with more and more segments (the zoo's seed000),
`checkpoint` around single operations (seed001) and `checkpoint_wrapper` around the whole model
(seed003), and cannot see why memory went up or stayed put. Building those hand-made schedules on the
planner's graph and simulating them shows why, in the same numbers and the same report as a plan:

- `equal_segments(graph, k)`: k segments of equal node count, all but the last checkpointed, as
  `checkpoint_sequential(model, k, x)` splits an `nn.Sequential`;
- `each_node(graph)`: every operation in its own checkpoint, as seed 001 wrote it;
- `whole_model(graph)`: one checkpoint around the whole forward, as `checkpoint_wrapper(model)` does;
- `each_block(graph, "blocks")`: every block of a ModuleList/Sequential in a checkpoint of its own, as
  Hugging Face's `gradient_checkpointing_enable()` does (the usual "per-block" baseline);
- `hand_schedules(graph)`: those a user could write for this graph that checkpoint something, for a
  compiled split step to try before it says no plan fits (NOTE [hand fallback] in
  compiled/split_step.py).

Nodes that cannot be checkpointed (the loss) are stored, as in the real code. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from planner.errors import format_bytes
from planner.ir import ActivationGraph, Phase, Region, RegionPolicy, Schedule, merge_stored
from planner.report.blocks import block_spans, main_container, numbered_containers
from planner.simulation.step import CheckpointRule, simulate

__all__ = [
    "WhatIf",
    "baselines",
    "compare",
    "each_block",
    "each_node",
    "equal_segments",
    "hand_schedules",
    "render_comparison",
    "whole_model",
]


def _region(
    graph: ActivationGraph, rule: CheckpointRule, start: int, stop: int, *, checkpoint: bool
) -> Region:
    """A CHECKPOINT region when asked and `rule` allows it, else a STORE region."""
    allowed = rule.allows(graph, start, stop)
    return Region(start, stop, RegionPolicy.CHECKPOINT if checkpoint and allowed else RegionPolicy.STORE)


def _body_end(graph: ActivationGraph) -> int:
    """Index after the last checkpointable node: what follows (the loss) runs outside the model."""
    return max((index + 1 for index, node in enumerate(graph.nodes) if node.checkpointable), default=0)


def equal_segments(graph: ActivationGraph, count: int) -> Schedule:
    """`count` segments of equal node count over the model, all but the last checkpointed."""
    if count < 1:
        raise ValueError(f"count must be a positive number of segments, got {count!r}")
    end = _body_end(graph)
    count = min(count, max(end, 1))
    bounds = [round(index * end / count) for index in range(count + 1)]
    rule = CheckpointRule.of(graph)
    regions = [
        _region(graph, rule, start, stop, checkpoint=number < count - 1)
        for number, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
        if stop > start
    ]
    if end < len(graph.nodes):
        regions.append(Region(end, len(graph.nodes), RegionPolicy.STORE))
    return Schedule(regions=merge_stored(regions), solver=f"{count} equal segments")


def each_node(graph: ActivationGraph) -> Schedule:
    """Every checkpointable node in a checkpoint of its own."""
    rule = CheckpointRule.of(graph)
    regions = [_region(graph, rule, index, index + 1, checkpoint=True) for index in range(len(graph.nodes))]
    return Schedule(regions=merge_stored(regions), solver="each op checkpointed")


def whole_model(graph: ActivationGraph) -> Schedule:
    """One checkpoint around the model's whole forward; the loss after it is stored."""
    end = _body_end(graph)
    regions = [_region(graph, CheckpointRule.of(graph), 0, end, checkpoint=True)] if end else []
    if end < len(graph.nodes):
        regions.append(Region(end, len(graph.nodes), RegionPolicy.STORE))
    return Schedule(regions=merge_stored(regions), solver="whole model checkpointed")


def each_block(graph: ActivationGraph, container: str) -> Schedule:
    """Every numbered child of `container` in a checkpoint of its own (what Hugging Face does)."""
    spans = block_spans(graph, container)
    if not spans:
        raise ValueError(
            f"no numbered children of {container!r} in the graph; containers with numbered children: "
            f"{numbered_containers(graph) or 'none'}"
        )
    regions: list[Region] = []
    position = 0
    rule = CheckpointRule.of(graph)
    for start, stop in spans:
        if start > position:
            regions.append(Region(position, start, RegionPolicy.STORE))
        regions.append(_region(graph, rule, start, stop, checkpoint=True))
        position = stop
    if position < len(graph.nodes):
        regions.append(Region(position, len(graph.nodes), RegionPolicy.STORE))
    return Schedule(regions=merge_stored(regions), solver=f"each block of {container or 'the model'}")


def baselines(graph: ActivationGraph) -> dict[str, Schedule]:
    """The schedules a plan is compared with: none, sqrt(n) equal segments, and every block if any."""
    segments = max(1, round(math.sqrt(_body_end(graph))))
    schedules = {
        "no checkpointing": equal_segments(graph, 1),
        f"sqrt(n) segments ({segments}, checkpoint_sequential)": equal_segments(graph, segments),
    }
    container = main_container(graph)
    if container is not None:
        schedules[f"every block of {container or 'the model'} (Hugging Face)"] = each_block(graph, container)
    return schedules


def hand_schedules(graph: ActivationGraph) -> dict[str, Schedule]:
    """The hand methods that can be written for `graph` and checkpoint something, by name: sqrt(n) equal
    segments (`checkpoint_sequential`) and every block of each numbered container (`checkpoint_wrapper`
    on each child); a schedule two methods share is named once."""
    segments = max(1, round(math.sqrt(_body_end(graph))))
    candidates = {f"sqrt(n) segments ({segments}, checkpoint_sequential)": equal_segments(graph, segments)}
    for container in numbered_containers(graph):
        candidates[f"every block of {container or 'the model'}"] = each_block(graph, container)
    schedules: dict[str, Schedule] = {}
    for name, schedule in candidates.items():
        if schedule.checkpointed and all(schedule.regions != kept.regions for kept in schedules.values()):
            schedules[name] = dataclasses.replace(schedule, solver=name)
    return schedules


@dataclass(frozen=True)
class WhatIf:
    """The predicted outcome of one schedule (all figures predicted by the simulator)."""

    name: str
    checkpointed_regions: int
    peak_bytes: int
    peak_phase: Phase
    overhead: float


def compare(graph: ActivationGraph, schedules: Mapping[str, Schedule]) -> list[WhatIf]:
    """Simulate each named schedule on `graph`, in the order given."""
    rows = []
    for name, schedule in schedules.items():
        result = simulate(graph, schedule)
        rows.append(
            WhatIf(
                name=name,
                checkpointed_regions=len(schedule.checkpointed),
                peak_bytes=result.peak_bytes,
                peak_phase=result.peak_phase,
                overhead=result.overhead,
            )
        )
    return rows


def render_comparison(rows: list[WhatIf], *, baseline_bytes: int | None = None) -> str:
    """A table of the rows; with `baseline_bytes`, each peak's change against it."""
    width = max((len(row.name) for row in rows), default=0)
    lines = [f"{'schedule':<{width}}  {'regions':>7}  {'predicted peak':>14}  {'set in':<14}  overhead"]
    for row in rows:
        change = ""
        if baseline_bytes is not None:
            sign = "+" if row.peak_bytes >= baseline_bytes else "-"
            change = f"  ({sign}{format_bytes(abs(row.peak_bytes - baseline_bytes))})"
        lines.append(
            f"{row.name:<{width}}  {row.checkpointed_regions:>7}  {format_bytes(row.peak_bytes):>14}  "
            f"{row.peak_phase.value:<14}  {row.overhead:>7.1%}{change}"
        )
    return "\n".join(lines)
