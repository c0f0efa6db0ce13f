"""A checkpointed region's replay in backward, as the simulator (step.py) and the solvers price it.

Why it exists: when backward reaches a checkpointed region's trigger (its last node that saved
anything), `torch.utils.checkpoint` runs the region's forward again up to there, and everything the
replay saves is alive at once until the nodes' backward frees it. What that replay holds node by node,
where it stops (NOTE [early stop] in step.py), what a selective policy keeps from forward (NOTE
[selective keeps] there) and what checkpoint's own work costs are the same wherever a region is
priced: in `simulate`, and in the dynamic programs and the ILP that choose regions without simulating
every candidate. `LiveBytes` is the running set of live storages both sides keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.ir import ActivationGraph, Node, Region, RegionPolicy
from planner.simulation.allocation_log import REPLAY_SUFFIX, AllocationLog

__all__ = [
    "LiveBytes",
    "Replay",
    "cache_name",
    "cached_creates",
    "checkpoint_overhead_ms",
    "replay_region",
    "replay_stop",
    "replay_workspace_bytes",
    "selective_overhead_ms",
    "stops_before_outputs",
]


def cache_name(graph: ActivationGraph, index: int) -> str:
    """Name of the pseudo-storage for what a kept node's cache holds beyond its `creates`."""
    return f"{graph.nodes[index].name}#cache"


def cached_creates(node: Node) -> tuple[str, ...]:
    """The storages among `node.creates` that a selective policy caches when it keeps the node."""
    return tuple(name for name in node.creates if name not in node.replayed_when_kept)


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
    with a `log`, its allocations there (the storages it makes again end in `REPLAY_SUFFIX`).

    NOTE [buffer copies]: so that a replay does not update BatchNorm's statistics a second time, the
    rewritten module copies every buffer of the region before replaying it and copies them back after
    (`_buffers_restored` in planner/rewrite/emit.py); the copies are alive through the whole replay.
    Uncounted, ResNet with every block checkpointed was predicted 3,072 bytes under its measurement
    (two BatchNorms' running mean, running variance and batch count). A compiled step's replay has no
    such copies (its buffer updates are functionalized), and its graph's nodes read no buffers."""
    copies_bytes = sum(node.buffer_bytes for node in graph.nodes[region.start : region.stop])
    copies = f"region{region.start}#buffer-copies"
    if log is not None:
        log.malloc(copies, copies_bytes)
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
    if log is not None:
        log.free(copies)
    return Replay(
        points_bytes=tuple(point + copies_bytes for point in points), kept=kept, recompute_ms=recompute_ms
    )


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
