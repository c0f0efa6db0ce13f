"""The order a compiled backward runs its kernels in (NOTE [backward order] in planner/compiled/optimize.py).

inductor would reorder each graph for peak memory with heuristics on kernels that do not exist yet when
the planner plans, so the planner chooses the backward's order itself, on its model of the kernels
(`backward_order` finds them in the joint graph as joint_reader.py reads it), and imposes it on the
partitioned backward. The first half of this module knows nothing of the joint graph: a kernel, the
peak of an order, inductor's least-peak-first heuristic, and the rewrite of an FX backward graph into a
chosen order, kept through inductor's fusion (`in_planned_order`). The second half (moved from
joint_graph.py, issue 36) chooses the order of a joint graph's backward and replays it node by node
(`backward_by_group`): what each node's backward step reads, holds and returns, which joint_graph.py
makes the nodes' backward figures of.

NOTE [saved outputs]: a value the forward both saves for backward and returns (a language model's
logits, returned beside the loss it computes) is saved as an output of the compiled autograd function,
and that reference lives until the whole backward has run: the backward can neither free it after its
last reader nor write a gradient into its memory, as it does with other saved values (NOTE [buffer
reuse]; AOT autograd "donates" only the others). Nor can it write into a tangent, the gradient autograd
hands it for an output (for unused logits, zeros it makes), which autograd still references. (In the
allocator traces measured, a tangent's memory came back only after the backward; the model frees it
after its last reader, which has not yet set a measured peak.) A three-layer language model returning
(loss, logits) measured one logits buffer (6 MiB, 26 %) above a model that let the backward reuse
them; Hugging Face's GPT-2, BERT and Llama were 7-10 % under (BERT: exact to 4 bytes since).

NOTE [order after fusion]: inductor's scheduler fuses a producer into a consumer far later in the
graph (the gradient of a diffusers U-Net's time embedding: one kernel early in the backward, summed
with every block's contribution at its end), gives the fused kernel the producer's place, and then
sorts the graph depth-first: every node that came after the producer and that the consumer does not
need ran after the fused kernel, at the end of the backward. Among them were the `getitem`s that take
the weight gradients out of each `convolution_backward`'s result, so each result, its input gradient
included, stayed allocated until then: that U-Net, without checkpointing, measured 6,269,952 B where
6,180,864 were predicted, and a plan under `activation_memory_budget=0.5`'s measured peak (5.26 MiB)
measured 219 KiB over its budget, its replans under lower budgets measured over it too, and the
budget was refused. inductor's own numbering (`min_order`) is not the planned order either: it
numbers a pointwise value when a kernel that cannot compute it inline is lowered, so a BatchNorm
backward's last kernel, planned before a replay that its convolution's backward also reads, was
numbered, and run, after that replay (the CNN of planner/testing/compiled_models.py at its lowest plan:
13.49 MB measured at the first compilation, 9.40 predicted). The planner's compiles instead sort the
nodes after fusion (`_post_fusion_custom_pass`) so that each runs as early as what it reads allows,
in the planned order: where the graph inductor lowers places the last FX operator the node computes
(`planned_positions`). That U-Net then measured its prediction to the byte, and the plan 1 KiB above
its prediction, within that budget; that CNN measured 11.50 MB (the rest: NOTE [replay copies] in
replay_copies.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from torch import fx

from planner.compiled.joint_reader import JointReader

__all__ = [
    "Backward",
    "Kernel",
    "after_fusion",
    "backward_by_group",
    "backward_order",
    "in_planned_order",
    "least_peak_first",
    "order_backward",
    "peak_of_order",
    "planned_positions",
    "readers_of",
]

LOSS_HELD = "loss.held"
"""The backward's pseudo-buffer for `LossProfile.held_bytes`."""


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


def in_planned_order(nodes: list[Any], planned_position: Mapping[Any, int]) -> list[Any]:
    """inductor's scheduler nodes after fusion, each run as early as what it reads allows, in the
    planned order (NOTE [order after fusion]): a topological order that picks the ready node whose
    `planned_position` comes first (then the one inductor made first: `min_order`)."""
    producer = {name: node for node in nodes for name in node.get_buffer_names()}
    waiting: dict[Any, int] = {}
    users: dict[Any, list[Any]] = {node: [] for node in nodes}
    for node in nodes:
        inputs = {producer[dep.name] for dep in node.unmet_dependencies if dep.name in producer} - {node}
        waiting[node] = len(inputs)
        for source in inputs:
            users[source].append(node)
    key = {node: (planned_position[node], node.min_order, index) for index, node in enumerate(nodes)}
    ready = [key[node] + (node,) for node in nodes if waiting[node] == 0]
    heapq.heapify(ready)
    ordered: list[Any] = []
    while ready:
        *_, node = heapq.heappop(ready)
        ordered.append(node)
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, key[user] + (user,))
    assert len(ordered) == len(nodes), "inductor's scheduler nodes do not form a DAG"
    return ordered


def planned_positions(nodes: Sequence[Any], graph_nodes: Sequence[fx.Node]) -> dict[Any, int]:
    """Each scheduler node -> the place in the graph inductor lowers (`graph_nodes`, in the planned
    order) of the last FX operator it computes, where its output is made; a node that names none
    takes the place of the node before it.

    NOTE [realized inputs]: an extern kernel (a convolution's backward) that needs its input in a
    layout realizes the pointwise kernel making it, and inductor names the extern operator among
    that kernel's origins too. A BatchNorm backward's pointwise tail then took the place of the
    convolution backward after it, behind the replay that convolution reads: the zoo's U-Net
    recomputed a 256 KiB ReLU output while the BatchNorm's gradient, its input and its output were
    all allocated, and a plan measured 187 KiB (3.3 %) above its prediction. A kernel that is not
    extern is placed by the operators it computes, not by those an extern kernel computes."""
    index = {node: position for position, node in enumerate(graph_nodes)}
    extern_operators = {
        origin
        for node in nodes
        if node.is_extern()
        for part in node.get_nodes()
        if part.node is not None
        for origin in part.node.get_origins()
        if origin.target == getattr(part.node, "op_overload", None)
    }
    positions: dict[Any, int] = {}
    last = 0
    for node in nodes:
        origins = _origins(node)
        if not node.is_extern():
            origins = (origins - extern_operators) or origins
        last = max((index[origin] for origin in origins if origin in index), default=last)
        positions[node] = last
    return positions


def _origins(node: Any) -> set[Any]:
    """The FX operators a scheduler node computes, as inductor names them."""
    return {
        origin for part in node.get_nodes() if part.node is not None for origin in part.node.get_origins()
    }


def after_fusion(nodes: list[Any]) -> list[Any]:
    """`_post_fusion_custom_pass`: the scheduler's nodes of the graph being compiled in the planned
    order (NOTE [order after fusion])."""
    from torch._inductor.virtualized import V

    graph = cast(fx.GraphModule, V.graph.module).graph
    return in_planned_order(nodes, planned_positions(nodes, list(graph.nodes)))


@dataclass
class Backward:
    """What one graph node's backward holds and makes (NOTE [measured residuals] in ir.py)."""

    saves: set[str] = field(default_factory=set)
    workspace_bytes: int = 0
    replay_workspace_bytes: int | None = None
    gradient_bytes: int = 0
    runs: bool = False
    points: list[tuple[int, frozenset[str]]] = field(default_factory=list)
    """(backward buffers live, saved storages freed before) after each of its kernels (NOTE [buffer
    reuse]; a reused saved storage counts as freed)."""
    kernels: list[str] = field(default_factory=list)
    """Names of the backward operators that run in this node's backward step, in order."""

    def release_points(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """`Node.backward_points`: the moments that can set the peak (each holding more than every
        earlier one; a later moment holding less has freed at least as much), none when nothing is
        freed part way."""
        kept: list[tuple[int, tuple[str, ...]]] = []
        for live_bytes, freed in self.points:
            if not kept or live_bytes > kept[-1][0]:
                kept.append((live_bytes, tuple(sorted(freed))))
        return tuple(kept) if any(freed for _, freed in kept) else ()


def _kernels(reader: JointReader) -> list[Kernel]:
    sizes = reader.storages.sizes
    gradient_storages = {
        name for node in reader.gradients if (name := reader.storages.name(node)) is not None
    }
    kernels = []
    for node in reader.backward:
        buffer = reader.backward_buffer(node)
        if buffer is None:
            continue
        reads = frozenset(read for read in reader.backward_fusion.inlined_reads[node] if read in sizes)
        kernels.append(Kernel(node, buffer, sizes[buffer], reads - {buffer}, buffer in gradient_storages))
    return kernels


def _freeable_inputs(reader: JointReader, kernels: Sequence[Kernel]) -> dict[str, int]:
    """Storages the backward receives and frees after their last reader: saved activations, tangents."""
    made = {kernel.buffer for kernel in kernels}
    return {
        name: reader.storages.sizes[name]
        for kernel in kernels
        for name in kernel.reads
        if name not in made and (name in reader.releasable_saved or name in reader.tangent_storages)
    }


def backward_order(reader: JointReader) -> list[Kernel]:
    """NOTE [backward order]."""
    kernels = _kernels(reader)
    inputs = _freeable_inputs(reader, kernels)
    memory_first = least_peak_first(kernels, inputs)
    return min((kernels, memory_first), key=lambda order: peak_of_order(order, inputs))


def backward_by_group(
    reader: JointReader, groups: list[list[fx.Node]], order: Sequence[Kernel], held_bytes: int
) -> list[Backward]:
    """Walk the backward kernel by kernel in `order` (NOTE [backward order]): the saved storages each
    group's backward reads, the backward buffers live while it runs (gradients in flight; not the
    saved activations, which the simulator holds), and the parameter gradients it returns.

    A kernel that needs the output's gradient runs in the backward step of the group whose operator
    it differentiates (`seq_nr`), or, when the order runs it later than that (a weight gradient
    deferred to the end), in the step of the group running at that time: backward steps only move
    towards the first node. A kernel that does not need the gradient (indices a max-pool backward
    derives from saved offsets) runs in the step that is current where the order puts it.

    NOTE [buffer reuse]: inductor frees a buffer after the last kernel that reads it, and gives a
    kernel's output the memory of an input of the same size and dtype that no later kernel reads (`#
    reuse` in its wrapper), saved activations included. The simulator holds a group's saved
    activations until the group's backward step ends; what the step's kernels free (or reuse) earlier
    becomes the node's `backward_points` (NOTE [early release] in simulation/step.py). `held_bytes` (the
    loss and its seed gradient) are live throughout.
    """
    group_of_seq = {
        seq: index
        for index, group in enumerate(groups)
        for node in group
        if (seq := node.meta.get("seq_nr")) is not None
    }
    backward = [Backward() for _ in groups]
    sizes = reader.storages.sizes
    last_use = {read: position for position, kernel in enumerate(order) for read in kernel.reads}
    live = {name: sizes[name] for name in reader.tangent_storages} | {LOSS_HELD: held_bytes}
    group, freed = len(groups) - 1, frozenset[str]()
    for position, kernel in enumerate(order):
        own_group = group_of_seq.get(kernel.node.meta.get("seq_nr"), group)
        step = min(group, own_group) if kernel.node in reader.gradient_dependent else group
        if step != group:
            group, freed = step, frozenset()
        entry = backward[group]
        entry.kernels.append(kernel.node.name)
        if not entry.runs:
            entry.runs = True
            entry.replay_workspace_bytes = sum(live.values())
        entry.saves |= kernel.reads & reader.saved_storages
        dying = sorted(read for read in kernel.reads if last_use[read] == position)
        taken = freed
        if kernel.gradient:
            entry.gradient_bytes += kernel.size_bytes
        else:
            reused = next(
                (
                    read
                    for read in dying
                    if _reusable(reader, read, live) and _same_buffer(reader, read, kernel.buffer)
                ),
                None,
            )
            if reused in live:
                del live[reused]
            elif reused is not None:
                taken = freed | {reused}
            live[kernel.buffer] = kernel.size_bytes
        entry.points.append((sum(live.values()) + reader.scratch_bytes.get(kernel.node, 0), taken))
        for read in dying:
            live.pop(read, None)
        freed |= {read for read in dying if read in reader.releasable_saved}
        if kernel.buffer not in last_use:
            live.pop(kernel.buffer, None)
    # a group whose backward runs no kernel of its own still sees the gradients passing by
    carried = 0
    for index in range(len(groups) - 1, -1, -1):
        entry = backward[index]
        if entry.runs:
            entry.workspace_bytes = max((live_bytes for live_bytes, _ in entry.points), default=0)
            carried = entry.workspace_bytes
        else:
            entry.workspace_bytes = carried
    return backward


def _reusable(reader: JointReader, name: str, live: dict[str, int]) -> bool:
    """Whether a kernel may write its output into dying `name` (NOTE [buffer reuse]): a buffer the
    backward made, or a saved value the forward does not also return; never a tangent, which autograd
    holds until the backward returns (NOTE [saved outputs])."""
    made_by_backward = name in live and name not in reader.tangent_storages
    return made_by_backward or name in reader.releasable_saved


def _same_buffer(reader: JointReader, first: str, second: str) -> bool:
    """Whether inductor may reuse storage `first` for `second` (NOTE [buffer reuse])."""
    storages = reader.storages
    return (
        storages.sizes[first] == storages.sizes[second] and storages.dtypes[first] == storages.dtypes[second]
    )
