"""The boundary view of an activation graph that the region solvers search over.

A schedule tiles the nodes (in execution order) into regions. Where a region may start is a choice of
plan space, not a property of the graph: non-reentrant checkpointing keeps whatever tensors enter a
region, so a region is executable whatever crosses its boundaries (skip connections, a DenseNet's
feature list, an encoder's output read by every decoder layer, masks). The candidate boundaries are

- every position where a module call starts or ends, at every depth of the module tree (a block, an
  attention, an encoder, a ModuleList's run of blocks, a leaf Linear). So every module call is a
  candidate region, and checkpointing every block (or every instance of any module type) by hand is a
  schedule of the space; and
- every *cut*: a position where only the previous node's outputs cross (crossing storages smaller than
  `NEGLIGIBLE_FRACTION` of the largest activation aside), the boundaries of a chain such as a
  Sequential of leaf modules.

Regions are listed along *ladders*: the boundaries of depth <= d for each depth d of the module tree,
plus a thinned copy of any ladder longer than `LADDER_POINTS`. A checkpointed region runs between two
points of one ladder of depth d at most `MAX_REGION_SEGMENTS` steps apart, passing no boundary
shallower than d: a run of sibling calls inside their parent's call (blocks i..j of a ModuleList, a
whole encoder, one attention, a Linear; on the finest ladder of a large graph, one step:
`FINEST_LADDER_MAX_BOUNDARIES`). The cuts make one more ladder, free of that rule: a region
between two cuts may span parts of several blocks, since only one storage crosses either end. Stored
regions span one step between neighbouring boundaries (a stored run costs what its steps cost one by one).

NOTE [held storages]: what a region costs depends on which of the storages crossing its start are
already *held* (retained until backward) by earlier regions: a stored node that saved it, or a
checkpointed region that took it as an input. Those are counted once, in the bytes earlier regions
retain; the others are the region's own. A crossing storage the region does not read (a U-Net skip
passing by) is live through the region's forward and, unless held, not in its backward. A solver's
state at a boundary is therefore (position, the crossing storages held so far), and region costs are
exact with respect to the simulator (simulation/step.py) for every state: the retained bytes before a region
plus each of its points is the simulated live activation memory at that moment (a test checks).

For a region [start, stop) under a policy, entered with `held_in`, `region_cost` returns:

- `charged_bytes`: activation bytes the region adds to what is retained until backward;
- `points_bytes`: the region's live bytes at each moment (forward nodes, its replay when checkpointed,
  its backward nodes) on top of what earlier regions retain, including parameter gradients and
  measured residuals;
- `recompute_ms`: forward time replayed in backward, and checkpoint's own time when checkpointed;
- `held_out`: the storages crossing `stop` that are held after the region.

NOTE [saved before made]: in a compiled step a node may save a storage that a *later* node makes.
inductor fuses a ReLU's backward into the kernel of the BatchNorm before it, so the BatchNorm's
backward step reads the ReLU's output; a residual block's output ReLU gets the next block's gradient
through it. Such a storage crosses every boundary from its first saver on (`first_touch`): the region
that saves it holds it and passes it on held, each region between that one and the one that makes it
counts it in its backward points (`awaited_bytes`), and the region that makes it charges it, so that
it is in the retained bytes from its making on, as in the simulator. Before this, the storage left
the held set at the next boundary and was charged again by its next saver: ResNet's compiled
no-checkpointing plan cost 14.1 MB of activations in the table against 9.9 MB simulated, and under a
budget that no checkpointing fits, plans recomputed up to 9 %.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from planner.ir import ActivationGraph, Region, RegionPolicy
from planner.simulation.replay import (
    LiveBytes,
    cache_name,
    cached_creates,
    checkpoint_overhead_ms,
    replay_region,
    replay_workspace_bytes,
)
from planner.simulation.step import (
    backward_workspace,
    cached_storages,
    held_storages,
    recompute_trigger,
    region_inputs,
    storage_sizes,
)

__all__ = [
    "Chain",
    "RegionCost",
    "RegionCostSummary",
    "State",
    "awaited_bytes",
    "boundary_depths",
    "build_chain",
    "keep_effect",
    "local_cost",
    "made_by",
    "passing_bytes",
    "region_cost",
    "storage_bytes",
]

NEGLIGIBLE_FRACTION = 1 / 32
"""A 4 x 48-token causal mask is 1/43 of a small GPT-2's largest activation (its attention scores);
at 1/64 it removed every cut between layers. Only where cuts are found: region costs count every
storage exactly (NOTE [held storages])."""
MAX_REGION_SEGMENTS = 16
"""Longest checkpointed region, in steps of its ladder. The lowest peaks come from regions of about
sqrt(ladder length) steps; on synthetic stacks of 200-2,000 nodes a limit of 24 found plans within
0.3 % of this one's recompute, at twice the tabulation time."""
LADDER_POINTS = 96
"""A ladder with more points than this also gets an evenly thinned copy of this many points, so that
long chains still have regions of many blocks (sqrt of 500 blocks is 22, beyond 16 steps)."""

FINEST_LADDER_MAX_BOUNDARIES = 400
"""On graphs with more boundaries than this, regions on the finest ladder (single leaf calls and their
neighbours) span one step: runs of leaf calls inside a block cost the 2,000-node encoder-decoder
benchmark five times the solve time (ilp 27.6 s instead of 5.0 s) for 24 % less recompute."""

State = tuple[int, frozenset[str]]
"""(boundary position, storages crossing it that earlier regions hold): see NOTE [held storages]."""


@dataclass(frozen=True)
class RegionCost:
    charged_bytes: int
    points_bytes: tuple[int, ...]
    recompute_ms: float
    held_out: frozenset[str] = frozenset()

    @cached_property
    def peak_bytes(self) -> int:
        return max(self.points_bytes)


@dataclass(frozen=True)
class Chain:
    """Candidate boundaries (0 and len(nodes) included), their ladders, and per-node facts."""

    graph: ActivationGraph
    boundaries: tuple[int, ...]
    depths: dict[int, int]
    """Per boundary: the depth of the shallowest module call that starts or ends there (0: the root)."""
    ladders: tuple[tuple[int, tuple[int, ...]], ...]
    """(depth d, the boundaries of depth <= d, or an evenly thinned copy of them)."""
    producer: dict[str, int]
    last_read: dict[str, int]
    last_use: dict[str, int]
    """Last node that reads or saves each storage (its producer if none does)."""
    crossing: dict[int, frozenset[str]]
    """Per boundary: storages made or saved before it and read or saved at or after it (NOTE [saved
    before made])."""
    gradient_bytes_from: tuple[int, ...]
    """Parameter-gradient bytes alive during backward of node i (produced by nodes i..n-1)."""
    sizes: dict[str, int]

    @cached_property
    def checkpoint_stops(self) -> dict[int, tuple[int, ...]]:
        """Per boundary: where a checkpointed region starting there may stop: up to MAX_REGION_SEGMENTS
        steps along a ladder of depth d, without passing a boundary shallower than d (a region of
        sibling calls stays inside their parent's call)."""
        stops: dict[int, set[int]] = {start: set() for start in self.boundaries}
        finest = max(depth for depth, _ in self.ladders)
        for depth, ladder in self.ladders:
            reach = MAX_REGION_SEGMENTS
            if depth == finest and depth > 0 and len(self.boundaries) > FINEST_LADDER_MAX_BOUNDARIES:
                reach = 1
            for i, start in enumerate(ladder[:-1]):
                for stop in ladder[i + 1 : i + 1 + reach]:
                    stops[start].add(stop)
                    if self.depths[stop] < depth:
                        break
        following = dict(zip(self.boundaries[:-1], self.boundaries[1:], strict=True))
        for start, stop in following.items():
            stops[start].add(stop)
        return {start: tuple(sorted(ends)) for start, ends in stops.items()}

    @cached_property
    def next_boundary(self) -> dict[int, int]:
        return dict(zip(self.boundaries[:-1], self.boundaries[1:], strict=True))


def _producers(graph: ActivationGraph) -> dict[str, int]:
    return {name: index for index, node in enumerate(graph.nodes) for name in node.creates}


def _last_uses(graph: ActivationGraph, producer: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(last forward read, last use including saves) per storage."""
    last_read = dict(producer)
    last_use = dict(producer)
    for index, node in enumerate(graph.nodes):
        for name in node.reads:
            last_read[name] = max(last_read.get(name, index), index)
            last_use[name] = max(last_use.get(name, index), index)
        for name in node.saves:
            last_use[name] = max(last_use.get(name, index), index)
    return last_read, last_use


def _exact_cuts(graph: ActivationGraph, producer: dict[str, int], last_use: dict[str, int]) -> list[int]:
    largest = max(graph.storage_bytes.values(), default=0)
    negligible = largest * NEGLIGIBLE_FRACTION
    blocked = [False] * (len(graph.nodes) + 1)
    for name, made_at in producer.items():
        if graph.storage_bytes[name] <= negligible:
            continue
        # Crossing a cut c means made_at < c <= last_use; only c == made_at + 1 is allowed.
        for position in range(made_at + 2, last_use[name] + 1):
            blocked[position] = True
    return [position for position in range(1, len(graph.nodes)) if not blocked[position]]


def _components(path: str) -> tuple[str, ...]:
    return tuple(path.split(".")) if path else ()


def _common_depth(left: tuple[str, ...], right: tuple[str, ...]) -> int:
    depth = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        depth += 1
    return depth


def boundary_depths(graph: ActivationGraph) -> dict[int, int]:
    """Positions where a module call starts or ends -> the depth of the shallowest such module.

    A node runs inside the modules named by the prefixes of its module path ("layers.3.mlp.fc" runs in
    "layers", "layers.3", "layers.3.mlp" and the leaf "layers.3.mlp.fc"); the root has depth 0. Between
    two nodes whose paths first differ at component k, the calls of the modules at depth k + 1 on either
    side start or end. Leaf calls (a Linear, a norm) count too: checkpointing every Linear by hand is
    a plan of the space, if rarely a good one.
    """
    paths = [_components(node.module_path) for node in graph.nodes]
    depths = {0: 0, len(graph.nodes): 0}
    for position in range(1, len(graph.nodes)):
        left, right = paths[position - 1], paths[position]
        if left != right:
            depths[position] = _common_depth(left, right) + 1
    return depths


CUT_LADDER_DEPTH = -1
"""The ladder of cuts passes any boundary: between two cuts only the cut's storage crosses, whatever
module calls lie between them."""


def _thinned(ladder: tuple[int, ...]) -> tuple[int, ...]:
    step = (len(ladder) - 1) / (LADDER_POINTS - 1)
    return tuple(sorted({ladder[round(i * step)] for i in range(LADDER_POINTS)}))


def _ladders(
    boundaries: list[int], depth_of: dict[int, int], cuts: list[int]
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    ladders: list[tuple[int, tuple[int, ...]]] = []
    for depth in sorted(set(depth_of.values())):
        ladder = tuple(position for position in boundaries if depth_of[position] <= depth)
        ladders.append((depth, ladder))
        if len(ladder) > LADDER_POINTS:
            ladders.append((depth, _thinned(ladder)))
    cut_ladder = (0, *cuts, boundaries[-1])
    if len(cut_ladder) > LADDER_POINTS:
        cut_ladder = _thinned(cut_ladder)
    ladders.append((CUT_LADDER_DEPTH, cut_ladder))
    return tuple(ladders)


def _first_touch(graph: ActivationGraph, producer: dict[str, int]) -> dict[str, int]:
    """Per storage a node makes: the first node that makes or saves it (NOTE [saved before made])."""
    first = dict(producer)
    for index, node in enumerate(graph.nodes):
        for name in node.saves:
            if name in first:
                first[name] = min(first[name], index)
    return first


def _crossing(
    boundaries: list[int], first_touch: dict[str, int], last_use: dict[str, int]
) -> dict[int, frozenset[str]]:
    crossing: dict[int, set[str]] = {position: set() for position in boundaries}
    for name, touched_at in first_touch.items():
        first = bisect.bisect_right(boundaries, touched_at)
        last = bisect.bisect_right(boundaries, last_use[name])
        for position in boundaries[first:last]:
            crossing[position].add(name)
    return {position: frozenset(names) for position, names in crossing.items()}


def build_chain(graph: ActivationGraph) -> Chain:
    """Find the candidate boundaries of `graph` and precompute what region costs need."""
    producer = _producers(graph)
    last_read, last_use = _last_uses(graph, producer)
    depth_of = boundary_depths(graph)
    paths = [_components(node.module_path) for node in graph.nodes]
    cuts = _exact_cuts(graph, producer, last_use)
    for cut in cuts:
        sibling_depth = _common_depth(paths[cut - 1], paths[cut]) + 1
        depth_of[cut] = min(depth_of.get(cut, sibling_depth), sibling_depth)
    boundaries = sorted(depth_of)
    gradient_bytes_from = [0] * (len(graph.nodes) + 1)
    for index in range(len(graph.nodes) - 1, -1, -1):
        gradient_bytes_from[index] = (
            gradient_bytes_from[index + 1] + graph.nodes[index].parameter_gradient_bytes
        )
    return Chain(
        graph=graph,
        boundaries=tuple(boundaries),
        depths=depth_of,
        ladders=_ladders(boundaries, depth_of, cuts),
        producer=producer,
        last_read=last_read,
        last_use=last_use,
        crossing=_crossing(boundaries, _first_touch(graph, producer), last_use),
        gradient_bytes_from=tuple(gradient_bytes_from[: len(graph.nodes)]),
        sizes=storage_sizes(graph),
    )


def storage_bytes(chain: Chain, names: Iterable[str]) -> int:
    return sum(chain.sizes[name.removesuffix("@replay")] for name in names)


def _forward_points(chain: Chain, region: Region, inputs: set[str], retained: set[str]) -> list[int]:
    """Live bytes of the region's own storages at each forward node, with the gradients alive through
    the forward alone (NOTE [loop orders] in ir.py); `retained` never leave in forward (held for
    backward, cached by a keep, or used after the region)."""
    graph = chain.graph
    forward_gradient_bytes = graph.static.forward_gradient_bytes
    keep = set(region.keep)
    live = LiveBytes(chain.sizes)

    def leaves_after(name: str) -> int | None:
        return None if name in retained else chain.last_read.get(name, -1)

    for name in inputs:
        live.add(name, leaves_after(name), region.start)
    points = []
    for index in range(region.start, region.stop):
        node = graph.nodes[index]
        created_bytes = sum(chain.sizes[name] for name in node.creates if name not in live.names)
        points.append(
            live.total_bytes + created_bytes + node.forward_workspace_bytes + forward_gradient_bytes
        )
        for name in node.creates:
            live.add(name, leaves_after(name), index)
        if index in keep:
            live.add(cache_name(graph, index), None, index)
        live.finish(index)
    return points


def _backward_points(
    chain: Chain, region: Region, held: dict[str, int], cached: set[str]
) -> tuple[list[int], float]:
    """Live bytes at the replay (if any) and at each backward node of the region, and recompute time."""
    graph = chain.graph
    trigger = recompute_trigger(graph, region) if region.policy is RegionPolicy.CHECKPOINT else None
    last = region.stop - 1
    pending = LiveBytes(chain.sizes, descending=True)
    for name in cached:
        pending.add(name, None, last)
    for name, at in held.items():
        pending.add(name, at, last)
    points: list[int] = []
    recompute_ms = 0.0
    for index in range(last, region.start - 1, -1):
        if index == trigger:
            for name in cached:
                pending.remove(name)
            replay = replay_region(graph, region, trigger, chain.last_read, chain.sizes)
            node = graph.nodes[index]
            arrived = (
                chain.gradient_bytes_from[index]
                - node.parameter_gradient_bytes
                + replay_workspace_bytes(graph, index)
            )
            points.extend(pending.total_bytes + point + arrived for point in replay.points_bytes)
            for name, at in replay.kept.items():
                pending.add(f"{name}@replay", at, index)
            recompute_ms = replay.recompute_ms
        flowing = chain.gradient_bytes_from[index] + backward_workspace(graph.nodes[index], pending, index)
        points.append(pending.total_bytes + flowing)
        pending.finish(index)
    return points, recompute_ms + checkpoint_overhead_ms(graph, region)


def passing_bytes(chain: Chain, region: Region, held_in: frozenset[str]) -> int:
    """Bytes crossing the region's start that it does not use and no earlier region holds: live through
    its forward (they are read after it), gone by its backward unless held."""
    passing = chain.crossing[region.start] - region_inputs(chain.graph, region) - held_in
    return storage_bytes(chain, passing)


def made_by(chain: Chain, names: Iterable[str], start: int, stop: int) -> set[str]:
    """The storages among `names` that nodes start..stop-1 make."""
    return {name for name in names if start <= chain.producer.get(name, -1) < stop}


def awaited_bytes(chain: Chain, region: Region, held_in: frozenset[str]) -> int:
    """Bytes held before the region that a node after it makes (NOTE [saved before made]): not yet in
    the bytes earlier regions retain, but alive through the region's backward."""
    return storage_bytes(chain, made_by(chain, held_in, region.stop, len(chain.graph.nodes)))


def local_cost(chain: Chain, region: Region, held_in: frozenset[str]) -> RegionCost:
    """`region_cost` without the storages passing by (see `passing_bytes`) or awaited (see
    `awaited_bytes`)."""
    graph = chain.graph
    inputs = region_inputs(graph, region)
    held = {name: at for name, at in held_storages(graph, region).items() if name not in held_in}
    # NOTE [saved before made]: held here and made later, or held earlier and made here
    awaited = made_by(chain, held, region.stop, len(graph.nodes))
    arriving = dict.fromkeys(made_by(chain, held_in, region.start, region.stop), region.start - 1)
    cached = cached_storages(graph, region)
    later = chain.crossing[region.stop]
    made_before = {name for name in inputs - held_in if chain.producer.get(name, -1) < region.start}
    forward = _forward_points(chain, region, made_before, set(held) | set(arriving) | cached | later)
    backward, recompute_ms = _backward_points(chain, region, held | arriving, cached)
    return RegionCost(
        charged_bytes=storage_bytes(chain, (set(held) - awaited) | set(arriving) | cached),
        points_bytes=tuple(forward) + tuple(backward),
        recompute_ms=recompute_ms,
        held_out=frozenset((held_in | set(held) | cached) & later),
    )


def region_cost(chain: Chain, region: Region, *, held_in: frozenset[str]) -> RegionCost:
    """Cost of `region` entered with the crossing storages `held_in` held (NOTE [held storages]).

    Each point is the region's live bytes at one moment (forward nodes, replayed nodes, backward
    nodes) on top of what earlier regions retain; the moments are the same for every `keep` set, so
    costs of different keep sets can be compared point by point (the ILP relies on that).
    """
    local = local_cost(chain, region, held_in)
    passing = passing_bytes(chain, region, held_in)
    awaited = awaited_bytes(chain, region, held_in)
    forward_count = region.stop - region.start
    points = local.points_bytes
    return RegionCost(
        charged_bytes=local.charged_bytes,
        points_bytes=tuple(point + passing for point in points[:forward_count])
        + tuple(point + awaited for point in points[forward_count:]),
        recompute_ms=local.recompute_ms,
        held_out=local.held_out,
    )


def keep_effect(chain: Chain, region: Region, index: int) -> tuple[tuple[int, ...], int]:
    """Change of each `region_cost` point, and of the charged bytes, when node `index` is also kept.

    Follows NOTE [selective keeps]: from the node's forward on, its outputs and cache stay until the
    replay; the replay finds them there before reaching the node, and skips its workspace at it.
    Equal to differencing `region_cost` with and without the keep (a test checks), but O(nodes).
    """
    graph = chain.graph
    node = graph.nodes[index]
    trigger = recompute_trigger(graph, region)
    assert (
        region.policy is RegionPolicy.CHECKPOINT and trigger is not None and region.start <= index <= trigger
    )
    cache_bytes = chain.sizes[cache_name(graph, index)]
    cached = cached_creates(node)
    created_bytes = storage_bytes(chain, cached)
    released_at: dict[int, int] = {}
    for name in cached:
        read = max(chain.last_read[name], index)
        released_at[read + 1] = released_at.get(read + 1, 0) + chain.sizes[name]
    forward = [0] * (index + 1 - region.start)
    held_bytes = cache_bytes
    for step in range(index + 1, region.stop):
        held_bytes += released_at.get(step, 0)
        forward.append(held_bytes)
    backward: list[int] = []
    for step in range(region.stop - 1, region.start - 1, -1):
        if step == trigger:
            for replayed in range(region.start, trigger + 1):
                if replayed < index:
                    backward.append(created_bytes + cache_bytes)
                elif replayed == index:
                    backward.append(cache_bytes - node.forward_workspace_bytes)
                else:
                    backward.append(0)
        backward.append(created_bytes + cache_bytes if step > trigger else 0)
    return tuple(forward + backward), created_bytes + cache_bytes


@dataclass(frozen=True)
class RegionCostSummary:
    """What the region DP needs of a `RegionCost`: its peak, what it charges, its recompute, and the
    nodes the region keeps (selective checkpointing) to get them."""

    peak_bytes: int
    charged_bytes: int
    recompute_ms: float
    keep: tuple[int, ...] = ()
