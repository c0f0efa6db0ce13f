"""Replays a schedule on an activation graph and predicts the peak memory of a training step.

The step is the steady state of `zero_grad(set_to_none=True)`, forward, loss, backward, `optimizer.step()`.
The first step differs only in that optimizer state does not exist until its optimizer step; that step
allocates the state while every gradient is alive, which is the same peak as the steady state's
optimizer step. So the peak over the first two steps is max(steady forward/backward, optimizer step).

Rules (they mirror `torch.utils.checkpoint` with `use_reentrant=False`):

- Forward. A node allocates `creates`, plus its measured workspace while it runs. A storage is freed after
  its last reader unless something retains it for backward.
- Retention. A storage saved by a node in a STORE region is retained until that node's backward. The
  inputs of a CHECKPOINT region are retained until the region's backward is done (checkpoint keeps them
  to replay the region). Tensors that nodes of a CHECKPOINT region save are not retained.
- Backward runs in reverse execution order (autograd's order on one device: highest sequence number
  first). At the first node of a CHECKPOINT region that saved anything, the region's forward is replayed
  up to that node; everything the replay saves is alive at once and is freed node by node afterwards.
- On top of the activation memory, each backward node adds its measured residual and the parameter
  gradients produced so far (see NOTE [measured residuals] in ir.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from planner.ir import (
    ActivationGraph,
    Phase,
    Region,
    RegionPolicy,
    Schedule,
    SimulationResult,
    TraceStep,
)

__all__ = ["simulate", "store_everything", "region_inputs", "recompute_trigger"]


def store_everything(graph: ActivationGraph, solver: str = "none") -> Schedule:
    """The schedule without checkpointing: one STORE region over all nodes."""
    return Schedule(regions=(Region(0, len(graph.nodes), RegionPolicy.STORE),), solver=solver)


def region_inputs(graph: ActivationGraph, region: Region) -> set[str]:
    """Activation storages made before `region` and read or saved inside it."""
    made_inside = {name for node in graph.nodes[region.start : region.stop] for name in node.creates}
    used = {name for node in graph.nodes[region.start : region.stop] for name in (*node.reads, *node.saves)}
    return used - made_inside


def recompute_trigger(graph: ActivationGraph, region: Region) -> int | None:
    """Index of the node whose backward replays `region`: the last one that saved anything."""
    for index in range(region.stop - 1, region.start - 1, -1):
        if graph.nodes[index].saves_anything:
            return index
    return None


@dataclass
class _Timeline:
    """Running peak and trace of a simulation."""

    peak_bytes: int = 0
    peak_phase: Phase = Phase.FORWARD
    peak_node: str = ""
    peak_breakdown: dict[str, int] | None = None

    def observe(self, phase: Phase, node: str, components: dict[str, int], trace: list[TraceStep]) -> None:
        total = sum(components.values())
        trace.append(
            TraceStep(phase=phase, node=node, live_bytes=total, peak_bytes=max(total, self.peak_bytes))
        )
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_phase, self.peak_node = total, phase, node
            self.peak_breakdown = dict(components)


def _release_index(graph: ActivationGraph, schedule: Schedule) -> dict[str, int]:
    """For each retained storage, the node after whose backward it is freed (the smallest holder)."""
    release: dict[str, int] = {}

    def hold(name: str, index: int) -> None:
        release[name] = min(index, release.get(name, index))

    for region in schedule.regions:
        if region.policy is RegionPolicy.STORE:
            for index in range(region.start, region.stop):
                for name in graph.nodes[index].saves:
                    hold(name, index)
        else:
            for name in region_inputs(graph, region):
                hold(name, region.start)
    return release


def _last_reads(graph: ActivationGraph) -> dict[str, int]:
    last: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.creates:
            last.setdefault(name, index)
        for name in node.reads:
            last[name] = index
    return last


def _bytes(graph: ActivationGraph, names: Iterable[str]) -> int:
    return sum(graph.storage_bytes[name] for name in names)


def _replay_region(graph: ActivationGraph, region: Region, trigger: int) -> tuple[int, dict[str, int]]:
    """Replay a checkpointed region's forward: (peak bytes of the replay, saved storage -> release index)."""
    kept: dict[str, int] = {}
    for index in range(region.start, trigger + 1):
        for name in graph.nodes[index].saves:
            kept[name] = min(index, kept.get(name, index))
    made_inside = {name for node in graph.nodes[region.start : trigger + 1] for name in node.creates}
    kept = {name: index for name, index in kept.items() if name in made_inside}
    last_read = {name: index for name, index in _last_reads(graph).items() if name in made_inside}
    live: set[str] = set()
    peak_bytes = 0
    for index in range(region.start, trigger + 1):
        node = graph.nodes[index]
        peak_bytes = max(
            peak_bytes, _bytes(graph, live) + _bytes(graph, node.creates) + node.forward_workspace_bytes
        )
        live.update(node.creates)
        live = {name for name in live if name in kept or min(last_read[name], trigger) > index}
    return peak_bytes, kept


def _static_components(graph: ActivationGraph) -> dict[str, int]:
    static = graph.static
    return {
        "parameters": static.parameter_bytes,
        "buffers": static.buffer_bytes,
        "inputs": static.input_bytes,
        "optimizer_state": static.optimizer_state_bytes,
    }


def _validate(graph: ActivationGraph, regions: Sequence[Region]) -> None:
    position = 0
    for region in regions:
        assert region.start == position and region.stop > region.start, f"regions must tile: {regions}"
        position = region.stop
        if region.policy is RegionPolicy.CHECKPOINT:
            blocked = [n.name for n in graph.nodes[region.start : region.stop] if not n.checkpointable]
            assert not blocked, f"region {region} checkpoints nodes that cannot be: {blocked}"
    assert position == len(graph.nodes), f"regions cover {position} of {len(graph.nodes)} nodes"


def simulate(graph: ActivationGraph, schedule: Schedule) -> SimulationResult:
    """Predict peak memory, the phase that sets it, and recompute time of `schedule` on `graph`."""
    _validate(graph, schedule.regions)
    static = _static_components(graph)
    release = _release_index(graph, schedule)
    last_read = _last_reads(graph)
    timeline = _Timeline()
    trace: list[TraceStep] = []

    live: set[str] = set()
    for index, node in enumerate(graph.nodes):
        running = _bytes(graph, live) + _bytes(graph, node.creates)
        timeline.observe(
            Phase.FORWARD,
            node.name,
            {**static, "activations": running, "workspace": node.forward_workspace_bytes},
            trace,
        )
        live.update(node.creates)
        live = {name for name in live if name in release or last_read[name] > index}

    triggers: dict[int, Region] = {}
    recompute_ms = 0.0
    for region in schedule.checkpointed:
        trigger = recompute_trigger(graph, region)
        if trigger is not None:
            triggers[trigger] = region
            recompute_ms += sum(node.forward_ms for node in graph.nodes[region.start : trigger + 1])

    pending = {name: release[name] for name in live}
    gradient_bytes = 0
    for index in range(len(graph.nodes) - 1, -1, -1):
        node = graph.nodes[index]
        gradient_bytes += node.parameter_gradient_bytes
        base = {**static, "gradients": gradient_bytes, "workspace": node.backward_workspace_bytes}
        if index in triggers:
            replay_peak_bytes, kept = _replay_region(graph, triggers[index], index)
            timeline.observe(
                Phase.RECOMPUTE,
                node.name,
                {**base, "activations": _pending_bytes(graph, pending), "recompute": replay_peak_bytes},
                trace,
            )
            pending.update({f"{name}@replay": at for name, at in kept.items()})
        timeline.observe(
            Phase.BACKWARD, node.name, {**base, "activations": _pending_bytes(graph, pending)}, trace
        )
        pending = {name: at for name, at in pending.items() if at < index}

    optimizer_components = {
        **static,
        "gradients": graph.static.gradient_bytes,
        "workspace": graph.static.optimizer_step_workspace_bytes,
    }
    if graph.optimizer != "none":
        timeline.observe(Phase.OPTIMIZER, "optimizer.step", optimizer_components, trace)

    step_ms = sum(node.forward_ms + node.backward_ms for node in graph.nodes)
    assert timeline.peak_breakdown is not None
    return SimulationResult(
        peak_bytes=timeline.peak_bytes,
        peak_phase=timeline.peak_phase,
        peak_node=timeline.peak_node,
        recompute_ms=recompute_ms,
        step_ms=step_ms,
        breakdown=timeline.peak_breakdown,
        trace=tuple(trace),
    )


def _pending_bytes(graph: ActivationGraph, pending: dict[str, int]) -> int:
    """Bytes of retained storages; replayed copies are named `<storage>@replay`."""
    return sum(graph.storage_bytes[name.removesuffix("@replay")] for name in pending)
