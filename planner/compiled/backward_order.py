"""The order a compiled backward runs its kernels in (NOTE [backward order] in planner/compiled/optimize.py).

inductor would reorder each graph for peak memory with heuristics on kernels that do not exist yet when
the planner plans, so the planner chooses the backward's order itself, on its model of the kernels
(joint_graph.py builds them from the joint graph), and imposes it on the partitioned backward. This
module holds the parts that know nothing of the joint graph: a kernel, the peak of an order, inductor's
least-peak-first heuristic, and the rewrite of an FX backward graph into a chosen order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

__all__ = ["Kernel", "least_peak_first", "order_backward", "peak_of_order", "readers_of"]


@dataclass(frozen=True)
class Kernel:
    """A backward operator that allocates a buffer: the unit the backward order is chosen over."""

    node: fx.Node
    buffer: str
    size_bytes: int
    reads: frozenset[str]
    """Backward buffers and freeable inputs (saved activations, the output's gradient) it reads."""
    gradient: bool
    """Its buffer is a gradient the backward returns: never freed inside the backward."""


def readers_of(kernels: Sequence[Kernel]) -> dict[str, list[Kernel]]:
    """Storage name -> the kernels that read it."""
    found: dict[str, list[Kernel]] = {}
    for kernel in kernels:
        for read in kernel.reads:
            found.setdefault(read, []).append(kernel)
    return found


def peak_of_order(order: Sequence[Kernel], inputs: dict[str, int]) -> int:
    """Peak live bytes of the backward run in `order` (inputs freed after their last reader)."""
    remaining = {name: len(readers) for name, readers in readers_of(order).items()}
    gradients = {kernel.buffer for kernel in order if kernel.gradient}
    sizes = dict(inputs) | {kernel.buffer: kernel.size_bytes for kernel in order}
    live = sum(inputs.values())
    peak = live
    for kernel in order:
        live += kernel.size_bytes
        peak = max(peak, live)
        for read in kernel.reads:
            remaining[read] -= 1
            if remaining[read] == 0 and read in sizes and read not in gradients:
                live -= sizes[read]
        if not kernel.gradient and kernel.buffer not in remaining:
            live -= kernel.size_bytes
    return peak


def least_peak_first(kernels: Sequence[Kernel], inputs: dict[str, int]) -> list[Kernel]:
    """inductor's LPMF topological order (`topological_sort_lpmf` in torch/_inductor/memory.py): while a
    ready kernel fits under the peak so far, run the one that leaves the least memory; else the one
    that allocates least."""
    consumers = readers_of(kernels)
    producer = {kernel.buffer: kernel for kernel in kernels}
    index = {kernel.node: position for position, kernel in enumerate(kernels)}
    sizes = dict(inputs) | {kernel.buffer: kernel.size_bytes for kernel in kernels}
    waiting = {kernel.node: len({read for read in kernel.reads if read in producer}) for kernel in kernels}
    outdegree = {
        name: len(readers) + (1 if name in producer and producer[name].gradient else 0)
        for name, readers in consumers.items()
    }
    to_free = {kernel.node: 0 for kernel in kernels}
    for kernel in kernels:
        to_free[kernel.node] += sum(
            sizes[read] for read in kernel.reads if outdegree.get(read) == 1 and read in sizes
        )
        if kernel.buffer not in outdegree and not kernel.gradient:
            to_free[kernel.node] += kernel.size_bytes
    live = sum(inputs.values())
    peak = max(live, sum(kernel.size_bytes for kernel in kernels if kernel.gradient))
    ready = [kernel for kernel in kernels if waiting[kernel.node] == 0]
    order: list[Kernel] = []
    while ready:
        gap = peak - live
        chosen = min(
            ready,
            key=lambda k: (
                k.size_bytes if k.size_bytes > gap else 0,
                k.size_bytes - to_free[k.node],
                index[k.node],
            ),
        )
        ready.remove(chosen)
        order.append(chosen)
        live += chosen.size_bytes
        peak = max(peak, live)
        live -= to_free[chosen.node]
        for consumer in consumers.get(chosen.buffer, []):
            waiting[consumer.node] -= 1
            if waiting[consumer.node] == 0:
                ready.append(consumer)
        for read in chosen.reads:
            outdegree[read] -= 1
            if outdegree[read] == 1:
                for consumer in consumers[read]:
                    to_free[consumer.node] += sizes.get(read, 0)
    assert len(order) == len(kernels), "the backward's kernels do not form a DAG"
    return order


def order_backward(backward: fx.GraphModule, kernel_order: Sequence[str]) -> fx.GraphModule:
    """`backward` with its operators run in `kernel_order` (NOTE [backward order]): each kernel is placed
    after what it needs, and everything else (views, values computed inside kernels, recomputed
    forward values) just before its first user, as `reordering_to_mimic_autograd_engine` places them."""
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    position = {node: index for index, node in enumerate(backward.graph.nodes)}
    by_name = {node.name: node for node in backward.graph.nodes}

    def place(node: fx.Node) -> None:
        needed: set[fx.Node] = set()
        pending = [node]
        while pending:
            current = pending.pop()
            if current in copied or current in needed:
                continue
            needed.add(current)
            pending += current.all_input_nodes
        for current in sorted(needed, key=position.__getitem__):
            copied[current] = graph.node_copy(current, copied.__getitem__)

    for node in backward.graph.find_nodes(op="placeholder"):
        place(node)
    for name in kernel_order:
        if name in by_name:
            place(by_name[name])
    for node in backward.graph.nodes:
        place(node)
    return fx.GraphModule(backward, graph)
