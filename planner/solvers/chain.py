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
than `NEGLIGIBLE_FRACTION` of the largest activation are ignored when finding cuts, so that a tiny
long-lived tensor (position ids) does not remove every cut; the simulator still counts them, and the
solvers check their result with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.ir import ActivationGraph, Region, RegionPolicy
from planner.simulate import recompute_trigger, region_inputs

__all__ = ["Chain", "RegionCost", "build_chain", "region_cost"]

NEGLIGIBLE_FRACTION = 1 / 64
MAX_CUTS = 96
"""More cuts than this are thinned evenly: region costs are O(cuts^2 * nodes) to tabulate."""


@dataclass(frozen=True)
class RegionCost:
    charged_bytes: int
    peak_bytes: int
    recompute_ms: float


@dataclass(frozen=True)
class Chain:
    """Cut positions (0 and len(nodes) included) and per-node facts the region costs need."""

    graph: ActivationGraph
    cuts: tuple[int, ...]
    producer: dict[str, int]
    last_read: dict[str, int]
    gradient_bytes_from: tuple[int, ...]
    """Parameter-gradient bytes alive during backward of node i (produced by nodes i..n-1)."""


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
    )


def _bytes(chain: Chain, names: set[str]) -> int:
    return sum(chain.graph.storage_bytes[name] for name in names)


def _held_by(chain: Chain, region: Region) -> dict[str, int]:
    """Storages a region retains for backward -> index of the node after whose backward they go."""
    held: dict[str, int] = {}
    if region.policy is RegionPolicy.STORE:
        for index in range(region.start, region.stop):
            for name in chain.graph.nodes[index].saves:
                held[name] = min(index, held.get(name, index))
    else:
        held = {name: region.start for name in region_inputs(chain.graph, region)}
    return held


def _forward_peak(chain: Chain, region: Region, inputs: set[str], held: dict[str, int]) -> int:
    live = set(inputs)
    peak_bytes = 0
    for index in range(region.start, region.stop):
        node = chain.graph.nodes[index]
        peak_bytes = max(
            peak_bytes, _bytes(chain, live) + _bytes(chain, set(node.creates)) + node.forward_workspace_bytes
        )
        live.update(node.creates)
        live = {name for name in live if name in held or chain.last_read.get(name, -1) > index}
    return peak_bytes


def _replay_peak(chain: Chain, region: Region, trigger: int) -> tuple[int, dict[str, int]]:
    graph = chain.graph
    made = {name for node in graph.nodes[region.start : trigger + 1] for name in node.creates}
    kept: dict[str, int] = {}
    for index in range(region.start, trigger + 1):
        for name in graph.nodes[index].saves:
            if name in made:
                kept[name] = min(index, kept.get(name, index))
    live: set[str] = set()
    peak_bytes = 0
    for index in range(region.start, trigger + 1):
        node = graph.nodes[index]
        peak_bytes = max(
            peak_bytes, _bytes(chain, live) + _bytes(chain, set(node.creates)) + node.forward_workspace_bytes
        )
        live.update(node.creates)
        live = {name for name in live if name in kept or min(chain.last_read[name], trigger) > index}
    return peak_bytes, kept


def region_cost(chain: Chain, region: Region, *, previous_stores: bool) -> RegionCost:
    """Cost of `region` (between two cuts) when the region before it is STORE (`previous_stores`) or not."""
    graph = chain.graph
    inputs = region_inputs(graph, region)
    before = graph.nodes[region.start - 1] if region.start > 0 else None
    already = inputs & set(before.saves) if (previous_stores and before is not None) else set()
    held = {name: at for name, at in _held_by(chain, region).items() if name not in already}
    forward_peak = _forward_peak(chain, region, inputs - already, held)

    pending = dict(held)
    backward_peak = 0
    recompute_ms = 0.0
    trigger = recompute_trigger(graph, region) if region.policy is RegionPolicy.CHECKPOINT else None
    for index in range(region.stop - 1, region.start - 1, -1):
        node = graph.nodes[index]
        flowing = chain.gradient_bytes_from[index] + node.backward_workspace_bytes
        retained = sum(graph.storage_bytes[name.removesuffix("@replay")] for name in pending)
        if index == trigger:
            replay_bytes, kept = _replay_peak(chain, region, trigger)
            backward_peak = max(backward_peak, retained + replay_bytes + flowing)
            pending.update({f"{name}@replay": at for name, at in kept.items()})
            retained = sum(graph.storage_bytes[name.removesuffix("@replay")] for name in pending)
            recompute_ms = sum(n.forward_ms for n in graph.nodes[region.start : trigger + 1])
        backward_peak = max(backward_peak, retained + flowing)
        pending = {name: at for name, at in pending.items() if at < index}
    return RegionCost(
        charged_bytes=_bytes(chain, set(held)),
        peak_bytes=max(forward_peak, backward_peak),
        recompute_ms=recompute_ms,
    )
