"""Replays a schedule on an activation graph and predicts the peak memory of a training step.

The step is the steady state of the graph's `TrainingStep` (ir.py): `zero_grad`, one or more
micro-batches of forward, loss and backward, then `GradScaler.unscale_` and `clip_grad_norm_` when
used, then `optimizer.step()`. The first step differs only in that optimizer state does not exist until
its optimizer step; that step allocates the state while every gradient is alive, which is the same peak
as the steady state's optimizer step. So the peak over the first two steps is max(steady
forward/backward, unscale, clipping, optimizer step).

A graph is the micro-batch of its `TrainingStep` that sets the forward/backward peak
(micro_batches.py, NOTE [accumulated gradients]); the simulator needs no notion of micro-batches.

Rules (they mirror `torch.utils.checkpoint` with `use_reentrant=False`):

- Forward. A node allocates `creates`, plus its measured workspace while it runs. A storage is freed after
  its last reader unless something retains it for backward.
- Retention. A storage saved by a node in a STORE region is retained until that node's backward. The
  inputs of a CHECKPOINT region are retained until the region's backward is done (checkpoint keeps them
  to replay the region). Tensors that nodes of a CHECKPOINT region save are not retained.
- Backward runs in reverse execution order (autograd's order on one device: highest sequence number
  first). At the first node of a CHECKPOINT region that saved anything (the trigger), the region's
  forward is replayed up to that node; everything the replay saves is alive at once and is freed node
  by node afterwards.
- On top of the activation memory, each backward node adds its measured residual and the parameter
  gradients produced so far (see NOTE [measured residuals] in ir.py).

NOTE [early release]: eager autograd frees a node's saved tensors when its backward is done; a
compiled backward frees each buffer after the last kernel that reads it, so a node whose backward
reads a saved storage first (a weight gradient from its input) and then makes its largest buffer (the
input gradient) holds the two at different times. Such a node lists `backward_points`: its workspace
at those moments and the saved storages freed before each. Where the schedule releases a storage at
that node (it is not held for a later one), the simulator subtracts it there, a storage the node's own
replay made included (a compiled backward recomputes a value just before its first reader and frees it
after its last; so the workspace is read once the replay's storages are pending).

NOTE [early stop]: non-reentrant checkpoint stops a replay as soon as the last tensor the region's
backward needs is saved again. Autograd saves an operator's inputs before it runs the operator and its
outputs after, so a trigger that saves only tensors made before it (a Linear saves its input) stops the
replay before it allocates its outputs or workspace, and before its operator runs, so it adds no
recompute time; one that saves what it makes (a ReLU its output) stops after. Every storage a node saves
that it did not receive is among its `creates`, so the two cases are told apart by the graph alone
(`stops_before_outputs`). A node of many operators (an opaque module call) may save its last tensor
before its last operators run: the profiling step measures its forward's peak up to that save
(`Node.replay_stop_bytes`), and a replay it triggers holds that and the saved outputs it made, not its
whole forward (issue 35: 139,776 bytes on a mixture-of-experts block). Its time is charged whole, an
upper bound: its operators up to that save run again, and a composite one runs nearly all of them
(attention computed from its parts saves its probabilities for its last product; charging nothing
left a BERT attention's 0.53 ms out of every region ending there). The replay runs when the
trigger's backward unpacks its first saved tensor: the gradients in flight have arrived, the
gradients it computes (and its parameters') are not made yet. The profiling step measures what is
live at that unpack (`Node.replay_workspace_bytes`, see profiler/interpreter.py).

NOTE [selective keeps]: a node in a CHECKPOINT region's `keep` runs under a selective checkpoint policy
that saves its operators' outputs (MUST_SAVE). What those operators allocate, less the casts and
in-place scratch the policy replays (`keep_cache_bytes`), is cached from its forward until the
replay; the replay does not run the node but takes its outputs from the cache, so the node adds no
workspace and no recompute time there.
The part of the cache that is not the node's `creates` (operator outputs it used internally) is
freed when the replay passes the node. Tests check this against measured peaks.

NOTE [split calls]: a module whose forward the capture could not follow (data-dependent routing in a
mixture of experts, a module with hooks) runs as Python code, and its children are profiled as parts of
its call (`Node.part_of`): the call's own code between child calls (glue) and each child call. The
rewriter can checkpoint the whole call, as one captured node, or one child call, by running that child
under checkpoint inside a copy of the module; it cannot cut the Python code in between. So a
checkpointed region may start or stop strictly inside a split call only when it is exactly one child
call (`CheckpointRule`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planner.ir import (
    GLUE_OP,
    NO_OPTIMIZER,
    ActivationGraph,
    Component,
    Node,
    Phase,
    Region,
    RegionPolicy,
    Schedule,
    SimulationResult,
    TraceStep,
)
from planner.simulation.allocation_log import REPLAY_SUFFIX, AllocationLog
from planner.simulation.micro_batches import describe_micro_batch

FORWARD_GRADIENTS = "#forward-gradients"
"""The allocation log's name for the last step's gradients alive through the forward (NOTE [loop
orders] in ir.py)."""

__all__ = [
    "CheckpointRule",
    "LiveBytes",
    "Replay",
    "backward_workspace",
    "cache_name",
    "cached_storages",
    "checkpoint_overhead_ms",
    "held_storages",
    "last_reads",
    "recompute_trigger",
    "region_inputs",
    "replay_region",
    "replay_stop",
    "replay_workspace_bytes",
    "selective_overhead_ms",
    "simulate",
    "stops_before_outputs",
    "storage_sizes",
    "store_everything",
]


@dataclass(frozen=True)
class CheckpointRule:
    """Which node ranges a CHECKPOINT region may cover: checkpointable nodes only, and no boundary
    strictly inside a split call except around exactly one of its child calls (NOTE [split calls])."""

    blocked_before: tuple[int, ...]
    """Per position: how many nodes before it cannot be checkpointed (prefix counts, O(1) queries)."""
    inner: frozenset[int]
    """Positions between two parts of one split call."""

    @classmethod
    def of(cls, graph: ActivationGraph) -> CheckpointRule:
        blocked = [0]
        for node in graph.nodes:
            blocked.append(blocked[-1] + (not node.checkpointable))
        nodes = graph.nodes
        inner = frozenset(
            position
            for position in range(1, len(nodes))
            if nodes[position].part_of and nodes[position].part_of == nodes[position - 1].part_of
        )
        return cls(blocked_before=tuple(blocked), inner=inner)

    def allows(self, graph: ActivationGraph, start: int, stop: int) -> bool:
        """Whether nodes [start, stop) may form one checkpointed region."""
        if self.blocked_before[stop] != self.blocked_before[start]:
            return False
        if start in self.inner or stop in self.inner:
            return stop == start + 1 and graph.nodes[start].op != GLUE_OP
        return True


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


def cache_name(graph: ActivationGraph, index: int) -> str:
    """Name of the pseudo-storage for what a kept node's cache holds beyond its `creates`."""
    return f"{graph.nodes[index].name}#cache"


def cached_creates(node: Node) -> tuple[str, ...]:
    """The storages among `node.creates` that a selective policy caches when it keeps the node."""
    return tuple(name for name in node.creates if name not in node.replayed_when_kept)


def storage_sizes(graph: ActivationGraph) -> dict[str, int]:
    """Bytes of every storage, plus each node's cache beyond its creates (for selective keeps)."""
    sizes = dict(graph.storage_bytes)
    for index, node in enumerate(graph.nodes):
        created = sum(graph.storage_bytes[name] for name in cached_creates(node))
        sizes[cache_name(graph, index)] = max(0, node.keep_cache_bytes - created)
    return sizes


def last_reads(graph: ActivationGraph) -> dict[str, int]:
    """Index of the last node that reads each storage in forward (its producer if none does)."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.creates:
            last.setdefault(name, index)
        for name in node.reads:
            last[name] = index
    return last


def held_storages(graph: ActivationGraph, region: Region) -> dict[str, int]:
    """Storages a region retains for backward -> index of the node after whose backward they go."""
    held: dict[str, int] = {}
    if region.policy is RegionPolicy.STORE:
        for index in range(region.start, region.stop):
            for name in graph.nodes[index].saves:
                held[name] = min(index, held.get(name, index))
    else:
        held = {name: region.start for name in region_inputs(graph, region)}
    return held


def cached_storages(graph: ActivationGraph, region: Region) -> set[str]:
    """What the selective policy of `region` caches from forward until its replay."""
    cached: set[str] = set()
    for index in region.keep:
        cached.update(cached_creates(graph.nodes[index]))
        cached.add(cache_name(graph, index))
    return cached


@dataclass(frozen=True)
class Replay:
    """A checkpointed region's replay: live bytes at each replayed node, and what stays for backward."""

    points_bytes: tuple[int, ...]
    kept: dict[str, int]
    recompute_ms: float
    """Forward time of the replayed nodes, plus the selective policy's overhead when the region keeps."""

    @property
    def peak_bytes(self) -> int:
        return max(self.points_bytes, default=0)


class LiveBytes:
    """Storages alive at a moment, with their running total; each leaves after a set step.

    Steps count up in forward and replay and down in backward (`descending=True`); a storage whose
    step has passed when it is added leaves after the current step. This keeps timelines O(nodes)
    where re-summing the live set at every node would be O(nodes^2) on long regions. With a `log`,
    each storage entering and leaving is also an allocation and a free there (named with `suffix`).
    """

    def __init__(
        self,
        sizes: dict[str, int],
        *,
        descending: bool = False,
        log: AllocationLog | None = None,
        suffix: str = "",
    ) -> None:
        self.sizes = sizes
        self.descending = descending
        self.names: set[str] = set()
        self.total_bytes = 0
        self._leaving: dict[int, list[str]] = {}
        self._log = log
        self._suffix = suffix

    def add(self, name: str, leaves_after: int | None, current: int) -> None:
        """Make `name` live until after step `leaves_after` (None: until removed by hand)."""
        if name in self.names:
            return
        self.names.add(name)
        self.total_bytes += self.sizes[name.removesuffix(REPLAY_SUFFIX)]
        if self._log is not None:
            self._log.malloc(name + self._suffix)
        if leaves_after is not None:
            step = min(leaves_after, current) if self.descending else max(leaves_after, current)
            self._leaving.setdefault(step, []).append(name)

    def remove(self, name: str) -> None:
        if name in self.names:
            self.names.discard(name)
            self.total_bytes -= self.sizes[name.removesuffix(REPLAY_SUFFIX)]
            if self._log is not None:
                self._log.free(name + self._suffix)

    def leaving_at(self, step: int) -> list[str]:
        """Names that leave after `step`."""
        return self._leaving.get(step, [])

    def finish(self, step: int) -> None:
        """Drop what leaves after `step`."""
        for name in self._leaving.pop(step, ()):
            self.remove(name)


def replay_region(
    graph: ActivationGraph,
    region: Region,
    trigger: int,
    last_read: dict[str, int],
    sizes: dict[str, int],
    log: AllocationLog | None = None,
) -> Replay:
    """Replay `region` up to `trigger`: bytes the replay holds at each node (beyond what was live);
    with a `log`, its allocations there (the storages it makes again end in `REPLAY_SUFFIX`)."""
    made = {name for node in graph.nodes[region.start : trigger + 1] for name in node.creates}
    kept: dict[str, int] = {}
    for index in range(region.start, trigger + 1):
        for name in graph.nodes[index].saves:
            if name in made:
                kept[name] = min(index, kept.get(name, index))

    def leaves_after(name: str, current: int) -> int | None:
        return None if name in kept else min(last_read.get(name, current), trigger)

    live = LiveBytes(sizes, log=log, suffix=REPLAY_SUFFIX)
    for index in region.keep:
        live.add(cache_name(graph, index), index, region.start)
        for name in cached_creates(graph.nodes[index]):
            live.add(name, leaves_after(name, region.start), region.start)
    keep = set(region.keep)
    points: list[int] = []
    recompute_ms = 0.0
    for index in range(region.start, trigger + 1):
        node = graph.nodes[index]
        if index == trigger and stops_before_outputs(node):
            points.append(live.total_bytes)
        elif index in keep:
            remade = [name for name in node.replayed_when_kept if name not in live.names]
            points.append(live.total_bytes + sum(sizes[name] for name in remade))
            for name in remade:
                live.add(name, leaves_after(name, index), index)
        elif index == trigger and _stops_inside(node, sizes, live):
            # Only the saved outputs are made before the last save (NOTE [early stop]).
            saved_made = [name for name in node.creates if name in kept and name not in live.names]
            made_bytes = sum(sizes[name] for name in saved_made)
            running_bytes = max(node.replay_stop_bytes or 0, made_bytes)
            points.append(live.total_bytes + running_bytes)
            for name in saved_made:
                live.add(name, leaves_after(name, index), index)
            if log is not None:
                log.transient(f"{node.name}#replay-workspace", running_bytes - made_bytes)
            recompute_ms += node.forward_ms
        else:
            created_bytes = sum(sizes[name] for name in node.creates if name not in live.names)
            points.append(live.total_bytes + created_bytes + node.forward_workspace_bytes)
            for name in node.creates:
                live.add(name, leaves_after(name, index), index)
            if log is not None:
                log.transient(f"{node.name}#replay-workspace", node.forward_workspace_bytes)
            recompute_ms += node.forward_ms
        live.finish(index)
    recompute_ms += selective_overhead_ms(graph, region)
    return Replay(points_bytes=tuple(points), kept=kept, recompute_ms=recompute_ms)


def _stops_inside(node: Node, sizes: dict[str, int], live: LiveBytes) -> bool:
    """Whether a replay that ends at `node` stops part way through its forward, at its last save, below
    what running it whole holds (`Node.replay_stop_bytes`, NOTE [early stop])."""
    if node.replay_stop_bytes is None:
        return False
    created_bytes = sum(sizes[name] for name in node.creates if name not in live.names)
    return node.replay_stop_bytes < created_bytes + node.forward_workspace_bytes


def replay_workspace_bytes(graph: ActivationGraph, index: int) -> int:
    """What of the trigger's backward residual is live when its replay runs (NOTE [early stop]): as
    measured at the node's first unpack, or else bounded by the gradients in flight between the node
    before it in backward and itself, which both residuals hold."""
    measured = graph.nodes[index].replay_workspace_bytes
    if measured is not None:
        return measured
    workspace = graph.nodes[index].backward_workspace_bytes
    if index + 1 < len(graph.nodes):
        workspace = min(workspace, graph.nodes[index + 1].backward_workspace_bytes)
    return workspace


def backward_workspace(node: Node, pending: LiveBytes, index: int) -> int:
    """The node's backward residual on top of `pending` (NOTE [early release]): its measured or
    predicted workspace, less what it frees part way that the schedule releases at this node."""
    if not node.backward_points:
        return node.backward_workspace_bytes
    leaving = set(pending.leaving_at(index))
    sizes = pending.sizes

    def released(names: tuple[str, ...]) -> int:
        return sum(sizes[name] for name in names if name in leaving or f"{name}{REPLAY_SUFFIX}" in leaving)

    return max(workspace_bytes - released(freed) for workspace_bytes, freed in node.backward_points)


def _release_early(node: Node, pending: LiveBytes, index: int) -> int:
    """`backward_workspace`, first freeing the storages the node frees part way where that workspace is
    negative (its measured backward peak below its saves: NOTE [freed part way in eager backward] in
    profiler/calibration.py): the same live bytes, with no component below zero, and the allocation log
    frees them before the workspace rather than skip a negative one."""
    workspace = backward_workspace(node, pending, index)
    if workspace >= 0:
        return workspace
    freed = {name for _, names in node.backward_points for name in names}
    for name in list(pending.leaving_at(index)):
        if name.removesuffix(REPLAY_SUFFIX) in freed and name in pending.names:
            workspace += pending.sizes[name.removesuffix(REPLAY_SUFFIX)]
            pending.remove(name)
    return workspace


def stops_before_outputs(node: Node) -> bool:
    """Whether a replay that ends at `node` stops before the node allocates anything (NOTE [early stop])."""
    return not set(node.saves) & set(node.creates)


def replay_stop(graph: ActivationGraph, trigger: int) -> int:
    """One past the last node whose forward a replay up to `trigger` runs: a trigger that stops the
    replay before its outputs never runs its operator there (NOTE [early stop]), so it costs no time."""
    return trigger if stops_before_outputs(graph.nodes[trigger]) else trigger + 1


def checkpoint_overhead_ms(graph: ActivationGraph, region: Region, operators: int | None = None) -> float:
    """What checkpointing `region` costs beyond its replay: checkpoint's own work, once per region and
    per operator of its nodes (`operators`, counted here when not given)."""
    if region.policy is not RegionPolicy.CHECKPOINT:
        return 0.0
    if operators is None:
        operators = sum(node.operator_count for node in graph.nodes[region.start : region.stop])
    return graph.checkpoint_call_ms + graph.checkpoint_op_ms * operators


def selective_overhead_ms(graph: ActivationGraph, region: Region) -> float:
    """What running `region` under a selective policy adds (none without keeps; see
    profiler/selective_cost.py)."""
    if not region.keep:
        return 0.0
    operators = sum(node.operator_count for node in graph.nodes[region.start : region.stop])
    return graph.selective_op_overhead_ms * operators


def _bytes(sizes: dict[str, int], names: Iterable[str]) -> int:
    return sum(sizes[name.removesuffix(REPLAY_SUFFIX)] for name in names)


@dataclass
class _Timeline:
    """Running peak and trace of a simulation."""

    peak_bytes: int = 0
    peak_phase: Phase = Phase.FORWARD
    peak_node: str = ""
    peak_breakdown: dict[Component, int] | None = None

    def observe(
        self, phase: Phase, node: str, components: dict[Component, int], trace: list[TraceStep]
    ) -> None:
        total = sum(components.values())
        trace.append(
            TraceStep(phase=phase, node=node, live_bytes=total, peak_bytes=max(total, self.peak_bytes))
        )
        if total > self.peak_bytes or self.peak_breakdown is None:
            self.peak_bytes, self.peak_phase, self.peak_node = total, phase, node
            self.peak_breakdown = dict(components)


def _static_components(graph: ActivationGraph) -> dict[Component, int]:
    static = graph.static
    return {
        Component.PARAMETERS: static.parameter_bytes,
        Component.BUFFERS: static.buffer_bytes,
        Component.INPUTS: static.input_bytes,
        Component.OPTIMIZER_STATE: static.optimizer_state_bytes,
        Component.GRADIENTS: static.resident_gradient_bytes,
    }


def _validate(graph: ActivationGraph, regions: Iterable[Region]) -> None:
    position = 0
    rule = CheckpointRule.of(graph)
    for region in regions:
        assert region.start == position and region.stop > region.start, f"regions must tile: {regions}"
        position = region.stop
        if region.policy is RegionPolicy.CHECKPOINT:
            names = [n.name for n in graph.nodes[region.start : region.stop]]
            assert rule.allows(graph, region.start, region.stop), (
                f"region {region} cannot be checkpointed: not every node may be, or it cuts a split call "
                f"(NOTE [split calls]): {names[:6]}"
            )
        assert all(region.start <= index < region.stop for index in region.keep), f"keep outside {region}"
        assert not region.keep or region.policy is RegionPolicy.CHECKPOINT, f"keep in a STORE region {region}"
    assert position == len(graph.nodes), f"regions cover {position} of {len(graph.nodes)} nodes"


def _retention(graph: ActivationGraph, schedule: Schedule) -> tuple[dict[str, int], dict[str, int]]:
    """(held storage -> release index, cached storage -> trigger of the replay that takes it)."""
    held: dict[str, int] = {}
    cached: dict[str, int] = {}
    for region in schedule.regions:
        for name, index in held_storages(graph, region).items():
            held[name] = min(index, held.get(name, index))
        trigger = recompute_trigger(graph, region) if region.policy is RegionPolicy.CHECKPOINT else None
        if trigger is not None:
            cached.update({name: trigger for name in cached_storages(graph, region)})
    return held, cached


def _after_backward(graph: ActivationGraph) -> list[tuple[Phase, str, int]]:
    """(phase, trace name, temporaries) of what runs on the gradients after the last backward, in order."""
    static, step = graph.static, graph.step
    phases = []
    if step.grad_scaler:
        phases.append((Phase.UNSCALE, "scaler.unscale_", static.unscale_workspace_bytes))
    if step.max_grad_norm is not None:
        phases.append((Phase.CLIP, "clip_grad_norm_", static.clip_workspace_bytes))
    if graph.optimizer != NO_OPTIMIZER:
        phases.append((Phase.OPTIMIZER, "optimizer.step", static.optimizer_step_workspace_bytes))
    return phases


def simulate(
    graph: ActivationGraph, schedule: Schedule, log: AllocationLog | None = None
) -> SimulationResult:
    """Predict peak memory, the phase that sets it, and recompute time of `schedule` on `graph`; with a
    `log` (made over `storage_sizes(graph)`), also record the step's allocations and frees in order."""
    _validate(graph, schedule.regions)
    sizes = storage_sizes(graph) if log is None else log.sizes
    static = _static_components(graph)
    held, cached = _retention(graph, schedule)
    last_read = last_reads(graph)
    timeline = _Timeline()
    trace: list[TraceStep] = []

    keep = {index for region in schedule.regions for index in region.keep}

    def leaves_after(name: str) -> int | None:
        return None if name in held or name in cached else last_read.get(name, -1)

    live = LiveBytes(sizes, log=log)
    forward_gradient_bytes = graph.static.forward_gradient_bytes  # NOTE [loop orders] in ir.py
    if log is not None:
        log.malloc(FORWARD_GRADIENTS, forward_gradient_bytes)
    for index, node in enumerate(graph.nodes):
        running = live.total_bytes + _bytes(sizes, node.creates)
        components = {
            **static,
            Component.GRADIENTS: static[Component.GRADIENTS] + forward_gradient_bytes,
            Component.ACTIVATIONS: running,
            Component.WORKSPACE: node.forward_workspace_bytes,
        }
        timeline.observe(Phase.FORWARD, node.name, components, trace)
        for name in node.creates:
            live.add(name, leaves_after(name), index)
        if log is not None:
            log.transient(f"{node.name}#workspace", node.forward_workspace_bytes)
        if index in keep:
            live.add(cache_name(graph, index), leaves_after(cache_name(graph, index)), index)
        live.finish(index)

    triggers = {
        trigger: region
        for region in schedule.checkpointed
        if (trigger := recompute_trigger(graph, region)) is not None
    }
    taken_at: dict[int, list[str]] = {}
    for name, trigger in cached.items():
        taken_at.setdefault(trigger, []).append(name)
    if log is not None:
        log.free(FORWARD_GRADIENTS)  # zero_grad between forward and backward
    last = len(graph.nodes) - 1
    pending = LiveBytes(sizes, descending=True, log=log)
    for name in live.names:
        pending.add(name, held.get(name, -1), last)
    retained_bytes = pending.total_bytes
    gradient_bytes = 0
    recompute_ms = sum(checkpoint_overhead_ms(graph, region) for region in schedule.regions)
    for index in range(last, -1, -1):
        node = graph.nodes[index]
        gradient_bytes += node.parameter_gradient_bytes
        if index in triggers:
            for name in taken_at.get(index, ()):
                pending.remove(name)
            in_flight = f"{node.name}#in-flight"
            if log is not None:
                log.malloc(in_flight, replay_workspace_bytes(graph, index))
            replay = replay_region(graph, triggers[index], index, last_read, sizes, log)
            if log is not None:
                log.free(in_flight)
            recompute_ms += replay.recompute_ms
            components = {
                **static,
                Component.GRADIENTS: static[Component.GRADIENTS]
                + gradient_bytes
                - node.parameter_gradient_bytes,
                Component.WORKSPACE: replay_workspace_bytes(graph, index),
                Component.ACTIVATIONS: pending.total_bytes,
                Component.RECOMPUTE: replay.peak_bytes,
            }
            timeline.observe(Phase.RECOMPUTE, node.name, components, trace)
            for name, at in replay.kept.items():
                pending.add(f"{name}{REPLAY_SUFFIX}", at, index)
        components = {
            **static,
            Component.GRADIENTS: static[Component.GRADIENTS] + gradient_bytes,
            Component.WORKSPACE: _release_early(node, pending, index),
            Component.ACTIVATIONS: pending.total_bytes,
        }
        timeline.observe(Phase.BACKWARD, node.name, components, trace)
        if log is not None:
            log.malloc(f"{node.name}#gradients", node.parameter_gradient_bytes)
            log.transient(f"{node.name}#backward-workspace", components[Component.WORKSPACE])
        pending.finish(index)

    for phase, node_name, workspace_bytes in _after_backward(graph):
        components = {
            **static,
            Component.GRADIENTS: graph.static.gradient_bytes,
            Component.WORKSPACE: workspace_bytes,
        }
        timeline.observe(phase, node_name, components, trace)
        if log is not None:
            log.transient(node_name, workspace_bytes)

    assert timeline.peak_breakdown is not None
    return SimulationResult(
        peak_bytes=timeline.peak_bytes,
        peak_phase=timeline.peak_phase,
        peak_node=timeline.peak_node,
        recompute_ms=recompute_ms,
        retained_bytes=retained_bytes,
        step_ms=sum(node.forward_ms + node.backward_ms for node in graph.nodes),
        breakdown=timeline.peak_breakdown,
        peak_micro_batch="" if timeline.peak_phase.after_backward else describe_micro_batch(graph.step),
        trace=tuple(trace),
    )
