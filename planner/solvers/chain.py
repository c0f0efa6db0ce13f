"""The chain view of an activation graph that the region solvers search over.

A *cut* is a position between two nodes where every activation that crosses it was made by the node
just before it. At a cut the graph is a chain: a region that starts there depends on earlier regions
only through those crossing storages. Transformer blocks meet at cuts (the residual stream alone
crosses); positions inside a block, where the residual and the branch both cross, are not cuts.

For a region [start, stop) between two cuts under a policy, `region_cost` returns:

- `charged_bytes`: activation bytes the region adds to what is retained until backward;
- `peak_bytes`: the region's highest memory on top of what earlier regions retain (forward, its own
  backward and, when checkpointed, its replay), including parameter gradients and measured residuals;
- `recompute_ms`: forward time replayed in backward.

These follow the simulator's rules (simulate.py) exactly when cuts are exact. Crossing storages smaller
than `NEGLIGIBLE_FRACTION` of the largest activation are ignored when finding cuts, so that a small
long-lived tensor (position ids, an attention mask or rotary table read by every layer) does not remove
every cut between layers; the simulator still counts them, and the solvers check their result with it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from functools import cached_property

from planner.ir import ActivationGraph, Region, RegionPolicy
from planner.simulate import (
    LiveBytes,
    cache_name,
    cached_storages,
    held_storages,
    recompute_trigger,
    region_inputs,
    replay_region,
    storage_sizes,
)

__all__ = ["Chain", "RegionCost", "RegionCosts", "RegionSummary", "build_chain", "region_cost"]

NEGLIGIBLE_FRACTION = 1 / 32
"""A 4 x 48-token causal mask is 1/43 of a small GPT-2's largest activation (its attention scores);
at 1/64 it removed every cut between layers and the lowest plan checkpointed both layers as one
region, 13 % above per-layer checkpointing. At training sizes masks are far smaller than this."""
MAX_CUTS = 96
"""More cuts than this are thinned evenly: region costs are O(cuts^2 * nodes) to tabulate."""


@dataclass(frozen=True)
class RegionCost:
    charged_bytes: int
    points_bytes: tuple[int, ...]
    recompute_ms: float

    @cached_property
    def peak_bytes(self) -> int:
        return max(self.points_bytes)


@dataclass(frozen=True)
class Chain:
    """Cut positions (0 and len(nodes) included) and per-node facts the region costs need."""

    graph: ActivationGraph
    cuts: tuple[int, ...]
    producer: dict[str, int]
    last_read: dict[str, int]
    gradient_bytes_from: tuple[int, ...]
    """Parameter-gradient bytes alive during backward of node i (produced by nodes i..n-1)."""
    sizes: dict[str, int]


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


def _thin(cuts: list[int], limit: int) -> list[int]:
    if len(cuts) <= limit:
        return cuts
    step = len(cuts) / limit
    return sorted({cuts[int(i * step)] for i in range(limit)})


def build_chain(graph: ActivationGraph) -> Chain:
    """Find the cuts of `graph` and precompute what region costs need."""
    producer = _producers(graph)
    last_read, last_use = _last_uses(graph, producer)
    cuts = [0, *_thin(_exact_cuts(graph, producer, last_use), MAX_CUTS), len(graph.nodes)]
    gradient_bytes_from = [0] * (len(graph.nodes) + 1)
    for index in range(len(graph.nodes) - 1, -1, -1):
        gradient_bytes_from[index] = (
            gradient_bytes_from[index + 1] + graph.nodes[index].parameter_gradient_bytes
        )
    return Chain(
        graph=graph,
        cuts=tuple(cuts),
        producer=producer,
        last_read=last_read,
        gradient_bytes_from=tuple(gradient_bytes_from[: len(graph.nodes)]),
        sizes=storage_sizes(graph),
    )


def _bytes(chain: Chain, names: Iterable[str]) -> int:
    return sum(chain.sizes[name.removesuffix("@replay")] for name in names)


def _forward_points(chain: Chain, region: Region, inputs: set[str], retained: set[str]) -> list[int]:
    graph = chain.graph
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
        points.append(live.total_bytes + created_bytes + node.forward_workspace_bytes)
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
        flowing = chain.gradient_bytes_from[index] + graph.nodes[index].backward_workspace_bytes
        if index == trigger:
            for name in cached:
                pending.remove(name)
            replay = replay_region(graph, region, trigger, chain.last_read, chain.sizes)
            points.extend(pending.total_bytes + point + flowing for point in replay.points_bytes)
            for name, at in replay.kept.items():
                pending.add(f"{name}@replay", at, index)
            recompute_ms = replay.recompute_ms
        points.append(pending.total_bytes + flowing)
        pending.finish(index)
    return points, recompute_ms


def region_cost(chain: Chain, region: Region, *, previous_stores: bool) -> RegionCost:
    """Cost of `region` (between two cuts) when the region before it is STORE (`previous_stores`) or not.

    Each point is the region's live bytes at one moment (forward nodes, replayed nodes, backward
    nodes) on top of what earlier regions retain; the moments are the same for every `keep` set, so
    costs of different keep sets can be compared point by point (the ILP relies on that).
    """
    graph = chain.graph
    inputs = region_inputs(graph, region)
    before = graph.nodes[region.start - 1] if region.start > 0 else None
    already = inputs & set(before.saves) if (previous_stores and before is not None) else set()
    held = {name: at for name, at in held_storages(graph, region).items() if name not in already}
    cached = cached_storages(graph, region)
    forward = _forward_points(chain, region, inputs - already, set(held) | cached)
    backward, recompute_ms = _backward_points(chain, region, held, cached)
    return RegionCost(
        charged_bytes=_bytes(chain, set(held) | cached),
        points_bytes=tuple(forward + backward),
        recompute_ms=recompute_ms,
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
    created_bytes = _bytes(chain, node.creates)
    released_at: dict[int, int] = {}
    for name in node.creates:
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
class RegionSummary:
    """What the region DP needs of a `RegionCost`: its peak, what it charges, its recompute, and the
    nodes the region keeps (selective checkpointing) to get them."""

    peak_bytes: int
    charged_bytes: int
    recompute_ms: float
    keep: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Shape:
    """A costed region structure: its peaks with the gradients of later nodes taken out."""

    forward_peak_bytes: int
    backward_peak_bytes: int
    """Highest backward (or replay) point less the parameter gradients of nodes after the region."""
    charged_bytes: int
    trigger_offset: int | None
    """Replay trigger minus region start; None when nothing is replayed."""
    cost: RegionCost
    """The full cost of the region this shape was costed at."""
    later_gradient_bytes: int
    """Parameter gradients of the nodes after that region (in its backward points)."""


class RegionCosts:
    """Summaries of `region_cost` for keep-free regions, computed once per region structure.

    Repeated blocks make regions that differ only in where they sit: each node reads and makes storages
    of the same sizes, at the same distances, with the same workspaces. Such regions share one cost,
    except for two terms that depend on position and are added per region: the parameter gradients of
    every later node (on each backward point) and the forward times (recompute). So tabulating a
    10,000-node stack of identical blocks costs about what its distinct region lengths do.

    Each node gets a structure key: its workspaces and flags, the sizes of what it makes, and each storage
    it reads or saves named by (distance back to its producer, position among the producer's outputs);
    last reads are distances, clipped at the longest region, beyond which every distance means "after
    the region". A storage made further back than the longest region is named literally (so a mask made
    once and read by every block keeps its identity). A region's key is its nodes' keys, its policy and,
    when the region before it stores, what that region's last node saves.
    """

    def __init__(self, chain: Chain, *, max_region_nodes: int) -> None:
        self.chain = chain
        self.horizon = max_region_nodes
        nodes = chain.graph.nodes
        interned: dict[Hashable, int] = {}
        self.node_keys = [interned.setdefault(self._node_key(i), len(interned)) for i in range(len(nodes))]
        self.save_keys = [
            interned.setdefault(tuple(self._reference(name, i) for name in node.saves), len(interned))
            for i, node in enumerate(nodes)
        ]
        self.forward_ms_before = [0.0]
        for node in nodes:
            self.forward_ms_before.append(self.forward_ms_before[-1] + node.forward_ms)
        self._shapes: dict[Hashable, _Shape] = {}

    def _reference(self, name: str, index: int) -> Hashable:
        chain = self.chain
        size = chain.sizes[name]
        last_read = chain.last_read.get(name)
        later = None if last_read is None else min(last_read - index, self.horizon)
        made_at = chain.producer.get(name)
        if made_at is None or index - made_at > self.horizon:
            return ("named", name, size, later)
        return (index - made_at, chain.graph.nodes[made_at].creates.index(name), size, later)

    def _node_key(self, index: int) -> Hashable:
        node = self.chain.graph.nodes[index]
        return (
            tuple(self._reference(name, index) for name in node.creates),
            tuple(self._reference(name, index) for name in node.reads),
            tuple(self._reference(name, index) for name in node.saves),
            node.saves_anything,
            node.checkpointable,
            node.forward_workspace_bytes,
            node.backward_workspace_bytes,
            node.parameter_gradient_bytes,
        )

    def _later_gradient_bytes(self, stop: int) -> int:
        gradients = self.chain.gradient_bytes_from
        return gradients[stop] if stop < len(gradients) else 0

    def _shape(self, region: Region, *, previous_stores: bool) -> _Shape:
        cost = region_cost(self.chain, region, previous_stores=previous_stores)
        forward_count = region.stop - region.start
        trigger = (
            recompute_trigger(self.chain.graph, region) if region.policy is RegionPolicy.CHECKPOINT else None
        )
        return _Shape(
            forward_peak_bytes=max(cost.points_bytes[:forward_count]),
            backward_peak_bytes=max(cost.points_bytes[forward_count:])
            - self._later_gradient_bytes(region.stop),
            charged_bytes=cost.charged_bytes,
            trigger_offset=None if trigger is None else trigger - region.start,
            cost=cost,
            later_gradient_bytes=self._later_gradient_bytes(region.stop),
        )

    def _costed_shape(self, region: Region, previous_stores: bool) -> _Shape:
        assert not region.keep, "structure keys describe keep-free regions"
        before = self.save_keys[region.start - 1] if previous_stores and region.start > 0 else None
        key = (region.policy, before, tuple(self.node_keys[region.start : region.stop]))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._shape(region, previous_stores=previous_stores)
        return shape

    def cost(self, region: Region, *, previous_stores: bool) -> RegionCost:
        """`region_cost(chain, region, previous_stores=...)`, from its shape when one was costed: the
        backward points shifted by the gradients of later nodes, the recompute summed as it does."""
        shape = self._costed_shape(region, previous_stores)
        shift = self._later_gradient_bytes(region.stop) - shape.later_gradient_bytes
        forward_count = region.stop - region.start
        points = shape.cost.points_bytes[:forward_count] + tuple(
            point + shift for point in shape.cost.points_bytes[forward_count:]
        )
        recompute_ms = 0.0
        if shape.trigger_offset is not None:
            replayed = self.chain.graph.nodes[region.start : region.start + shape.trigger_offset + 1]
            for node in replayed:
                recompute_ms += node.forward_ms
        return RegionCost(charged_bytes=shape.charged_bytes, points_bytes=points, recompute_ms=recompute_ms)

    def summary(self, region: Region, *, previous_stores: bool) -> RegionSummary:
        """`region_cost(chain, region, previous_stores=...)` summarised, shared across one structure.

        Recompute is a difference of running sums, so it may differ from `region_cost`'s in the last
        bits of the float.
        """
        shape = self._costed_shape(region, previous_stores)
        recompute_ms = 0.0
        if shape.trigger_offset is not None:
            replayed_to = region.start + shape.trigger_offset + 1
            recompute_ms = self.forward_ms_before[replayed_to] - self.forward_ms_before[region.start]
        return RegionSummary(
            peak_bytes=max(
                shape.forward_peak_bytes,
                shape.backward_peak_bytes + self._later_gradient_bytes(region.stop),
            ),
            charged_bytes=shape.charged_bytes,
            recompute_ms=recompute_ms,
        )

    @property
    def distinct_regions(self) -> int:
        """How many region structures were costed (the rest reused one of these)."""
        return len(self._shapes)
