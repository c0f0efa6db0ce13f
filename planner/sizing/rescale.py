"""One model's activation graph at other sizes, from captures at three: reuse when the graph only rescales.

Why it exists: `planner.capacity` needs the peak at many batch sizes or sequence lengths, and capturing
and profiling a large model takes seconds each time. When the graphs at two sizes differ only in their
numbers (the same nodes, the same storages created, read and saved by the same nodes, the same flags)
and every number is a polynomial of low degree in the size, three captures fix every other size: a
batch size scales bytes and FLOPs linearly, a sequence length quadratically where attention scores are
sequence x sequence.

How it stays honest (NOTE [rescaling]):
- `GraphFamily.fit` refuses graphs whose non-numeric fields differ between its three sizes.
- Each number is the quadratic through its three values, in exact rationals (Lagrange). At a size
  where any number comes out fractional or negative the family gives no graph (`graph_at` returns
  None) and the caller captures that size.
- A family is used only after a fourth capture equals its rescaling exactly (`mismatch`), and every
  later capture is compared again; the caller drops the family at the first difference. Between the
  checked sizes the polynomial is assumed, not known: a kernel that changes its workspace at some size
  between two captures would go unseen, which is why the caller also checks the size it answers with.
- In 512-byte blocks (the default counting, NOTE [counted bytes] in ir.py) a size rounded up to a block
  is a polynomial only where the exact size is a multiple of 512 at every size; elsewhere the quadratic
  through three rounded values misses a fourth capture (or comes out fractional), and the caller then
  captures every size it probes. Counting exact bytes (`memory_counting="exact"`) keeps reuse wherever
  the graph only rescales.
- Times are not rescaled. Analytic times (profiler/cost_model.py) are recomputed from the rescaled FLOPs
  and bytes by the same roofline; measured times are measurements of one size, so graphs with measured
  times have no family (`fit` raises).

Nothing here imports torch: this is arithmetic on `ir` records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from planner.ir import ActivationGraph, Node, StaticBytes
from planner.profiler.cost_model import BACKWARD_FACTOR, DeviceSpec, analytic_forward_ms

__all__ = ["FIT_SIZES", "GraphFamily", "NotRescalable"]

FIT_SIZES = 3
"""Captures a family is fitted from: a quadratic has three coefficients."""

NODE_NUMBERS = (
    "forward_workspace_bytes",
    "backward_workspace_bytes",
    "replay_workspace_bytes",
    "replay_stop_bytes",
    "replay_release_bytes",
    "parameter_gradient_bytes",
    "keep_cache_bytes",
    "buffer_bytes",
    "forward_flops",
    "moved_bytes",
    "operator_count",
)
"""Integer fields of a Node that may change with the size (replay_workspace_bytes and replay_stop_bytes
may be None). The workspaces of `backward_points` change too (after these, in order); how many points a
node has and what each frees must not."""

STATIC_NUMBERS = tuple(field.name for field in dataclasses.fields(StaticBytes))

TIME_TOLERANCE = 1e-9
"""Relative difference below which two recomputed analytic times are the same (float rounding)."""


class NotRescalable(ValueError):
    """Graphs that do not form a family; the message says which field differs."""


@dataclass(frozen=True)
class _Numbers:
    """A graph's numbers in one fixed order (storages, then node fields, then static fields)."""

    values: tuple[int | None, ...]
    labels: tuple[str, ...]
    """What each value is, for messages: `storage s12`, `node addmm_3 moved_bytes`, `static input_bytes`."""


def _numbers(graph: ActivationGraph) -> _Numbers:
    values: list[int | None] = []
    labels: list[str] = []
    for name, size_bytes in graph.storage_bytes.items():
        values.append(size_bytes)
        labels.append(f"storage {name}")
    for node in graph.nodes:
        for field in NODE_NUMBERS:
            values.append(getattr(node, field))
            labels.append(f"node {node.name} {field}")
        for point, (workspace_bytes, _) in enumerate(node.backward_points):
            values.append(workspace_bytes)
            labels.append(f"node {node.name} backward_points[{point}]")
    for field in STATIC_NUMBERS:
        values.append(getattr(graph.static, field))
        labels.append(f"static {field}")
    return _Numbers(tuple(values), tuple(labels))


def _zeroed(node: Node) -> dict[str, Any]:
    """Replacements that zero a node's numbers and times (None stays None)."""
    zeros: dict[str, Any] = {"forward_ms": 0.0, "backward_ms": 0.0}
    zeros.update({field: None if getattr(node, field) is None else 0 for field in NODE_NUMBERS})
    zeros["backward_points"] = tuple((0, freed) for _, freed in node.backward_points)
    return zeros


def _skeleton(graph: ActivationGraph) -> ActivationGraph:
    """`graph` with every number zeroed (None stays None): what must not change with the size."""
    nodes = tuple(dataclasses.replace(node, **_zeroed(node)) for node in graph.nodes)
    static_zeros: dict[str, Any] = dict.fromkeys(STATIC_NUMBERS, 0)
    static = dataclasses.replace(graph.static, **static_zeros)
    return dataclasses.replace(
        graph, nodes=nodes, static=static, storage_bytes=dict.fromkeys(graph.storage_bytes, 0)
    )


def _first_difference(left: ActivationGraph, right: ActivationGraph) -> str:
    """Where two skeletons differ, in words."""
    if list(left.storage_bytes) != list(right.storage_bytes):
        return f"storages differ ({len(left.storage_bytes)} against {len(right.storage_bytes)})"
    if len(left.nodes) != len(right.nodes):
        return f"node counts differ ({len(left.nodes)} against {len(right.nodes)})"
    for one, other in zip(left.nodes, right.nodes, strict=True):
        if one != other:
            fields = [
                f.name for f in dataclasses.fields(Node) if getattr(one, f.name) != getattr(other, f.name)
            ]
            return f"node {one.name} differs in {', '.join(fields)}"
    return "graph-level fields differ (capture path, optimizer, timing or training step)"


def _lagrange(sizes: Sequence[int], values: Sequence[int], size: int) -> Fraction:
    """The polynomial through (sizes[i], values[i]) evaluated at `size`, exactly."""
    total = Fraction(0)
    for i, (size_i, value_i) in enumerate(zip(sizes, values, strict=True)):
        weight = Fraction(1)
        for j, size_j in enumerate(sizes):
            if j != i:
                weight *= Fraction(size - size_j, size_i - size_j)
        total += value_i * weight
    return total


def _with_times(graph: ActivationGraph, spec: DeviceSpec) -> ActivationGraph:
    """`graph` with every node's times recomputed from its FLOPs and bytes (as profiler/interpreter.py
    does)."""
    nodes = []
    for node in graph.nodes:
        forward_ms = analytic_forward_ms(node.forward_flops, node.moved_bytes, spec, random=node.random)
        nodes.append(
            dataclasses.replace(node, forward_ms=forward_ms, backward_ms=BACKWARD_FACTOR * forward_ms)
        )
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _rebuild(skeleton: ActivationGraph, values: Sequence[int | None], spec: DeviceSpec) -> ActivationGraph:
    """The skeleton filled with `values` in `_numbers` order, with analytic times."""
    numbers = iter(values)
    storage_bytes: dict[str, Any] = {name: next(numbers) for name in skeleton.storage_bytes}
    nodes = []
    for node in skeleton.nodes:
        node_numbers: dict[str, Any] = {field: next(numbers) for field in NODE_NUMBERS}
        node_numbers["backward_points"] = tuple((next(numbers), freed) for _, freed in node.backward_points)
        nodes.append(dataclasses.replace(node, **node_numbers))
    static_numbers: dict[str, Any] = {field: next(numbers) for field in STATIC_NUMBERS}
    static = dataclasses.replace(skeleton.static, **static_numbers)
    graph = dataclasses.replace(skeleton, nodes=tuple(nodes), static=static, storage_bytes=storage_bytes)
    return _with_times(graph, spec)


@dataclass(frozen=True)
class GraphFamily:
    """Graphs of one model at any size, rescaled from captures at `sizes` (see NOTE [rescaling])."""

    sizes: tuple[int, ...]
    skeleton: ActivationGraph
    fitted: tuple[tuple[int | None, ...], ...]
    """Per size in `sizes`, the graph's numbers in `_numbers` order."""
    labels: tuple[str, ...]
    spec: DeviceSpec

    @classmethod
    def fit(cls, graphs: dict[int, ActivationGraph], spec: DeviceSpec) -> GraphFamily:
        """The family through `graphs` (size -> graph captured at that size, `FIT_SIZES` of them), whose
        times must be analytic on `spec`. Raises `NotRescalable` saying what differs."""
        if len(graphs) != FIT_SIZES:
            raise ValueError(f"a family is fitted from {FIT_SIZES} sizes, got {sorted(graphs)}")
        sizes = tuple(sorted(graphs))
        first = graphs[sizes[0]]
        if first.timing != f"analytic ({spec.name})":
            raise NotRescalable(
                f"times are {first.timing}, not analytic ({spec.name}): measured times are not rescaled"
            )
        skeleton = _skeleton(first)
        for size in sizes[1:]:
            other = _skeleton(graphs[size])
            if other != skeleton:
                raise NotRescalable(
                    f"the graph at {size} is not the graph at {sizes[0]} rescaled: "
                    f"{_first_difference(skeleton, other)}"
                )
        numbers = [_numbers(graphs[size]) for size in sizes]
        return cls(
            sizes=sizes,
            skeleton=skeleton,
            fitted=tuple(entry.values for entry in numbers),
            labels=numbers[0].labels,
            spec=spec,
        )

    def graph_at(self, size: int) -> ActivationGraph | None:
        """The rescaled graph at `size`, or None where a number would be fractional or negative."""
        values: list[int | None] = []
        for column in zip(*self.fitted, strict=True):
            if column[0] is None:
                values.append(None)
                continue
            value = _lagrange(self.sizes, [int(v) for v in column if v is not None], size)
            if value.denominator != 1 or value < 0:
                return None
            values.append(int(value))
        return _rebuild(self.skeleton, values, self.spec)

    def mismatch(self, size: int, captured: ActivationGraph) -> str | None:
        """None when `captured` (a fresh capture at `size`) equals the rescaled graph, number for number
        and time for time; else the first difference, in words."""
        rescaled = self.graph_at(size)
        if rescaled is None:
            return f"the rescaled graph at {size} has a fractional or negative byte count"
        if _skeleton(captured) != self.skeleton:
            return f"at {size}: {_first_difference(self.skeleton, _skeleton(captured))}"
        expected, found = _numbers(rescaled), _numbers(captured)
        for label, want, got in zip(expected.labels, expected.values, found.values, strict=True):
            if want != got:
                return f"at {size}, {label}: rescaled {want}, captured {got}"
        for want_node, got_node in zip(rescaled.nodes, captured.nodes, strict=True):
            for field in ("forward_ms", "backward_ms"):
                want_ms, got_ms = getattr(want_node, field), getattr(got_node, field)
                if abs(want_ms - got_ms) > TIME_TOLERANCE * max(abs(want_ms), abs(got_ms), 1e-12):
                    return f"at {size}, node {want_node.name} {field}: rescaled {want_ms}, captured {got_ms}"
        return None
