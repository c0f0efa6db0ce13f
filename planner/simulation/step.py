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
(`stops_before_outputs` in replay.py). A node of many operators (an opaque module call) may save its last
tensor before its last operators run: the profiling step measures its forward's peak up to that save
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
from planner.simulation.replay import (
    LiveBytes,
    cache_name,
    cached_creates,
    checkpoint_overhead_ms,
    replay_region,
    replay_workspace_bytes,
)

FORWARD_GRADIENTS = "#forward-gradients"
"""The allocation log's name for the last step's gradients alive through the forward (NOTE [loop
orders] in ir.py)."""

__all__ = [
    "CheckpointRule",
    "backward_workspace",
    "cached_storages",
    "held_storages",
    "last_reads",
    "recompute_trigger",
    "region_inputs",
    "simulate",
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
    """Storages a region retains for backward -> index of the node after whose backward they go.

    NOTE [regions that save nothing]: non-reentrant checkpoint keeps a region's inputs through the
    frame that its saved tensors' unpack hooks hold; a region whose operators save nothing for backward
    (a mask or rotary table made from tensors that need no grad) leaves no such hook, so its frame and
    inputs go when the call returns, and nothing is replayed. Holding them until its backward predicted
    √n segments of zoo_real Llama 12,800 bytes above their measurement (two regions of its prelude).
    A compiled step's regions are inductor's partitioner's to recompute, for any backward reader of
    what they make, so their inputs stay held (holding none raised a compiled U-Net's lowest plan
    2.5 KB above its prediction), and so do its outputs that its own backward reads and a node after
    it saves (NOTE [saved region outputs])."""
    held: dict[str, int] = {}
    if region.policy is RegionPolicy.STORE:
        for index in range(region.start, region.stop):
            for name in graph.nodes[index].saves:
                held[name] = min(index, held.get(name, index))
    elif graph.compiled:
        held = {name: region.start for name in region_inputs(graph, region)}
        held |= _saved_outputs(graph, region)
    elif recompute_trigger(graph, region) is not None:
        held = {name: region.start for name in region_inputs(graph, region)}
    return held


def _saved_outputs(graph: ActivationGraph, region: Region) -> dict[str, int]:
    """NOTE [saved region outputs]: in a compiled step, what a checkpointed region makes, a node after
    it saves, and one of its own nodes' backward reads -> the first such node.

    A compiled backward step reads what its kernels read, and a kernel that fuses a ReLU's backward
    into the BatchNorm backward before it is the BatchNorm node's: that node saves the ReLU's output,
    which the next node (a convolution) saves too. The planner asks the partitioner to save what a
    region after the checkpointed one keeps, and inductor's backward then reads that saved value
    wherever it is read, instead of recomputing it. Released after the later node's backward only, as
    an eager step would release it, the zoo's U-Net was predicted 201 KiB (5 %) under its measurement
    in plans that checkpoint its last block: its last ReLU's output was freed before the block's
    replay, where the compiled backward still held it. Only a value a later node saves is held so:
    holding every output a later node reads made the partition save values that a later node only
    reads (Hugging Face's GPT-2 with dropout: its lowest peak 0.13 MiB higher), where inductor
    recomputes them."""
    nodes = graph.nodes[region.start : region.stop]
    made_inside = {name for node in nodes for name in node.creates}
    saved_inside = {name for node in nodes for name in node.saves} & made_inside
    if not saved_inside:
        return {}
    saved_after = saved_inside & {name for node in graph.nodes[region.stop :] for name in node.saves}
    held: dict[str, int] = {}
    for index in range(region.start, region.stop):
        for name in saved_after.intersection(graph.nodes[index].saves):
            held.setdefault(name, index)
    return held


def cached_storages(graph: ActivationGraph, region: Region) -> set[str]:
    """What the selective policy of `region` caches from forward until its replay."""
    cached: set[str] = set()
    for index in region.keep:
        cached.update(cached_creates(graph.nodes[index]))
        cached.add(cache_name(graph, index))
    return cached


def backward_workspace(node: Node, pending: LiveBytes, index: int) -> int:
    """The node's backward residual on top of `pending` (NOTE [early release]): its measured or
    predicted workspace, less what it frees part way that the schedule releases at this node, and less
    its `replay_release_bytes` where everything it saves is a replay's copy leaving at it (NOTE
    [replay's early frees] in profiler/calibration.py): from a workspace of `backward_points` even
    below zero, as `_release_early` frees those saves first; from any other only what is there."""
    workspace = node.backward_workspace_bytes
    if node.backward_points:
        leaving = set(pending.leaving_at(index))
        sizes = pending.sizes

        def released(names: tuple[str, ...]) -> int:
            return sum(
                sizes[name] for name in names if name in leaving or f"{name}{REPLAY_SUFFIX}" in leaving
            )

        workspace = max(workspace_bytes - released(freed) for workspace_bytes, freed in node.backward_points)
    if node.replay_release_bytes and _all_saves_replayed_here(node, pending, index):
        if node.backward_points:  # the saves it frees part way leave first (`_release_early`)
            workspace -= node.replay_release_bytes
        elif workspace > 0:
            workspace -= min(node.replay_release_bytes, workspace)
    return workspace


def _all_saves_replayed_here(node: Node, pending: LiveBytes, index: int) -> bool:
    """Whether every storage `node` saves is a replay's copy that leaves at its backward."""
    leaving = set(pending.leaving_at(index))
    return bool(node.saves) and all(f"{name}{REPLAY_SUFFIX}" in leaving for name in node.saves)


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
