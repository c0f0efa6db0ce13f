"""Region costs shared across repeated structure: the table `dp` and `ilp` read, costed once per shape.

Why it exists: a stack of identical layers has thousands of candidate regions but few distinct ones.
Costing each with `chain.region_cost` would make tabulation grow with the stack's length; costing each
region *structure* once makes it grow with the number of distinct structures (see `RegionCosts`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from planner.ir import Region, RegionPolicy
from planner.simulation.replay import checkpoint_overhead_ms, replay_stop
from planner.simulation.step import held_storages, recompute_trigger, region_inputs
from planner.solvers.chain import (
    Chain,
    RegionCost,
    RegionCostSummary,
    awaited_bytes,
    local_cost,
    made_by,
    storage_bytes,
)

__all__ = ["RegionCosts"]


@dataclass(frozen=True)
class _Shape:
    """A costed region structure: its peaks with the gradients of later nodes taken out."""

    forward_peak_bytes: int
    """Highest forward point without the passing storages (they are added per region)."""
    backward_peak_bytes: int
    """Highest backward (or replay) point less the parameter gradients of nodes after the region."""
    charged_bytes: int
    trigger_offset: int | None
    """Replay trigger minus region start; None when nothing is replayed."""
    cost: RegionCost
    """The full cost of the region this shape was costed at, without passing storages."""
    later_gradient_bytes: int
    """Parameter gradients of the nodes after that region (in its backward points)."""


class RegionCosts:
    """Summaries of `region_cost` for keep-free regions, computed once per region structure.

    Repeated blocks make regions that differ only in where they sit: each node reads and makes storages
    of the same sizes, at the same distances, with the same workspaces. Such regions share one cost,
    except for terms that depend on position and are added per region: the parameter gradients of
    every later node and the held storages a later node makes (on each backward point), the forward
    times (recompute), the storages passing by (on each forward point) and which crossing storages stay
    held (`held_out`).

    Each node gets a structure key: its workspaces and flags, the sizes of what it makes, and each storage
    it reads or saves named by (distance back to its producer, position among the producer's outputs);
    last reads and uses are distances, clipped at the longest region, beyond which every distance means
    "after the region". A storage made further back than the longest region is named literally (so a
    mask made once and read by every block keeps its identity). A region's key is its nodes' keys, its
    policy and which of its inputs earlier regions hold.
    """

    def __init__(self, chain: Chain, *, max_region_nodes: int) -> None:
        self.chain = chain
        self.horizon = max_region_nodes
        nodes = chain.graph.nodes
        interned: dict[Hashable, int] = {}
        self.node_keys = [interned.setdefault(self._node_key(i), len(interned)) for i in range(len(nodes))]
        self.forward_ms_before = [0.0]
        self.operators_before = [0]
        for node in nodes:
            self.forward_ms_before.append(self.forward_ms_before[-1] + node.forward_ms)
            self.operators_before.append(self.operators_before[-1] + node.operator_count)
        self._shapes: dict[Hashable, _Shape] = {}
        self._inputs: dict[tuple[int, int], frozenset[str]] = {}
        self._entering: dict[tuple[int, int], frozenset[str]] = {}
        self._held: dict[tuple[int, int, RegionPolicy], frozenset[str]] = {}

    def _reference(self, name: str, index: int) -> Hashable:
        chain = self.chain
        size = chain.sizes[name]
        last_read = chain.last_read.get(name)
        later = None if last_read is None else min(last_read - index, self.horizon)
        used = min(chain.last_use.get(name, index) - index, self.horizon)
        made_at = chain.producer.get(name)
        if made_at is None or index - made_at > self.horizon:
            return ("named", name, size, later, used)
        return (index - made_at, chain.graph.nodes[made_at].creates.index(name), size, later, used)

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
            tuple(
                (workspace_bytes, tuple(self._reference(name, index) for name in freed))
                for workspace_bytes, freed in node.backward_points
            ),
            node.replay_workspace_bytes,
            node.replay_stop_bytes,
            node.replay_release_bytes,
            node.buffer_bytes,
            node.parameter_gradient_bytes,
        )

    def _later_gradient_bytes(self, stop: int) -> int:
        gradients = self.chain.gradient_bytes_from
        return gradients[stop] if stop < len(gradients) else 0

    def inputs(self, start: int, stop: int) -> frozenset[str]:
        key = (start, stop)
        if key not in self._inputs:
            self._inputs[key] = frozenset(
                region_inputs(self.chain.graph, Region(start, stop, RegionPolicy.STORE))
            )
        return self._inputs[key]

    def entering(self, start: int, stop: int) -> frozenset[str]:
        """Storages whose being held changes the region's cost: its inputs, and what it makes that an
        earlier node saved (NOTE [saved before made] in chain.py)."""
        key = (start, stop)
        if key not in self._entering:
            made_here = made_by(self.chain, self.chain.crossing[start], start, stop)
            self._entering[key] = self.inputs(start, stop) | made_here
        return self._entering[key]

    def held_out(self, region: Region, held_in: frozenset[str]) -> frozenset[str]:
        """Crossing storages held after a keep-free `region` entered with `held_in`."""
        key = (region.start, region.stop, region.policy)
        if key not in self._held:
            self._held[key] = frozenset(held_storages(self.chain.graph, region))
        return (held_in | self._held[key]) & self.chain.crossing[region.stop]

    def _shape(self, region: Region, held_inputs: frozenset[str]) -> _Shape:
        cost = local_cost(self.chain, region, held_inputs)
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

    def _costed_shape(self, region: Region, held_in: frozenset[str]) -> tuple[_Shape, int]:
        """The region's shape (costed with only its held inputs, so no passing storage) and the bytes
        passing by, which its forward points add."""
        assert not region.keep, "structure keys describe keep-free regions"
        held_inputs = held_in & self.entering(region.start, region.stop)
        held_key = tuple(sorted(repr(self._reference(name, region.start)) for name in held_inputs))
        nodes = self.chain.graph.nodes
        # A replay at the region's last node sees the gradients in flight from the node after it.
        after = nodes[region.stop].backward_workspace_bytes if region.stop < len(nodes) else None
        key = (region.policy, held_key, after, tuple(self.node_keys[region.start : region.stop]))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._shape(region, held_inputs)
        passing = self.chain.crossing[region.start] - self.inputs(region.start, region.stop) - held_in
        return shape, storage_bytes(self.chain, passing)

    def _overhead_ms(self, region: Region) -> float:
        operators = self.operators_before[region.stop] - self.operators_before[region.start]
        return checkpoint_overhead_ms(self.chain.graph, region, operators)

    def _recompute_ms(self, region: Region, shape: _Shape) -> float:
        call_ms = self._overhead_ms(region)
        if shape.trigger_offset is None:
            return call_ms
        replayed_to = replay_stop(self.chain.graph, region.start + shape.trigger_offset)
        return call_ms + self.forward_ms_before[replayed_to] - self.forward_ms_before[region.start]

    def cost(self, region: Region, *, held_in: frozenset[str]) -> RegionCost:
        """`region_cost(chain, region, held_in=...)`, from its shape when one was costed: the backward
        points shifted by the gradients of later nodes, the forward ones by the passing storages."""
        shape, passing = self._costed_shape(region, held_in)
        shift = (
            self._later_gradient_bytes(region.stop)
            - shape.later_gradient_bytes
            + awaited_bytes(self.chain, region, held_in)
        )
        forward_count = region.stop - region.start
        points = tuple(point + passing for point in shape.cost.points_bytes[:forward_count]) + tuple(
            point + shift for point in shape.cost.points_bytes[forward_count:]
        )
        recompute_ms = self._overhead_ms(region)
        if shape.trigger_offset is not None:
            replayed_to = replay_stop(self.chain.graph, region.start + shape.trigger_offset)
            for node in self.chain.graph.nodes[region.start : replayed_to]:
                recompute_ms += node.forward_ms
        return RegionCost(
            charged_bytes=shape.charged_bytes,
            points_bytes=points,
            recompute_ms=recompute_ms,
            held_out=self.held_out(region, held_in),
        )

    def summary(self, region: Region, *, held_in: frozenset[str]) -> RegionCostSummary:
        """`region_cost(chain, region, held_in=...)` summarised, shared across one structure.

        Recompute is a difference of running sums, so it may differ from `region_cost`'s in the last
        bits of the float.
        """
        shape, passing = self._costed_shape(region, held_in)
        return RegionCostSummary(
            peak_bytes=max(
                shape.forward_peak_bytes + passing,
                shape.backward_peak_bytes
                + self._later_gradient_bytes(region.stop)
                + awaited_bytes(self.chain, region, held_in),
            ),
            charged_bytes=shape.charged_bytes,
            recompute_ms=self._recompute_ms(region, shape),
        )

    @property
    def distinct_regions(self) -> int:
        """How many region structures were costed (the rest reused one of these)."""
        return len(self._shapes)
