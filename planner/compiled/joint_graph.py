"""The compiled step as the planner sees it: an ActivationGraph built from AOT autograd's joint graph.

Under `torch.compile` the eager graph is not what runs. AOT autograd traces forward and backward into
one joint FX graph of aten operators, inductor's partitioner decides which forward values the backward
gets (saved) and which it recomputes, and inductor fuses chains of pointwise operators into kernels
whose intermediates never reach memory. This module reads that joint graph, as the partitioner
receives it, into the same `ActivationGraph` the eager planner builds from a profiling step, so that
the simulator and the solvers plan the compiled step unchanged:

- nodes are the forward's aten operators grouped by the eager operator they decompose (autograd's
  sequence number: a LayerNorm is one node, not its eight decomposed operators), in forward order,
  with the module path of the call they belong to;
- storages are the buffers inductor materialises (NOTE [fusion model] in fusion.py), sized
  from the graph's fake tensors; views share their base's storage;
- what a node "saves" is what its backward reads of the partition without checkpointing (inductor's
  own min-cut partition at activation_memory_budget=1.0), following recomputed values back to saved
  ones; a checkpointed region of a plan keeps its inputs instead and its backward recomputes the rest;
- the backward's own buffers (gradients in flight) and the parameter gradients it returns are found by
  a liveness pass over the joint graph's backward, in the order autograd ran it (backward_order.py,
  over the joint graph as joint_reader.py reads it), and become each node's backward workspace and
  parameter gradients (NOTE [measured residuals] in ir.py, here predicted);
- times are analytic (FLOPs and bytes on a roofline, profiler/cost_model.py): the compiled kernels do
  not exist yet when the partitioner runs.

NOTE [layout copies]: on the CPU (mkldnn) inductor runs convolutions in channels-last and copies
every parameter and graph input a convolution reads that is not channels-last already (a 3x3 weight,
the image) at the start of the forward; the backward's convolutions read the copies, so they are
saved. No operator of the joint graph makes them: they are storages of a node of their own, first,
which no plan checkpoints, and each convolution's node reads and saves its copies.

NOTE [saved outputs] (a value the forward saves and returns stays allocated through the backward) is in
backward_order.py, with the walk of the backward it explains.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._functorch.partitioners import NodeInfo, OpTypes, get_default_op_list
from torch.utils.flop_counter import flop_registry

from planner.compiled.backward_order import Backward, backward_by_group, backward_order
from planner.compiled.fusion import is_primal, target_name
from planner.compiled.groups import (
    REPLAYABLE_RANDOM,
    checkpointable_group,
    is_random,
    operator_groups,
    place_hoisted,
    random_draws,
)
from planner.compiled.joint_reader import JointReader
from planner.ir import COMPILED_CAPTURE, ActivationGraph, Node, Schedule, StaticBytes
from planner.profiler.cost_model import BACKWARD_FACTOR, DeviceSpec, analytic_forward_ms
from planner.profiler.counting import current_counting
from planner.profiler.interpreter import LOSS_NODE
from planner.simulation.step import held_storages

__all__ = ["CompiledGraph", "LossProfile", "build_compiled_graph"]

LAYOUT_COPY_NODE = "channels_last_copies"
MODULE_PREFIX = re.compile(r"^L\['self'\]\.?")
MODULES_ACCESS = re.compile(r"\._modules\['([^']+)'\]")


@dataclass(frozen=True)
class LossProfile:
    """The loss as it runs outside the compiled graph (eagerly, on the model's output), measured."""

    forward_workspace_bytes: int
    """Peak bytes the loss allocates beyond its inputs while it runs."""
    saved_bytes: int
    """Bytes the loss's autograd keeps until its backward (e.g. log-softmax of the logits)."""
    backward_workspace_bytes: int
    """Peak bytes of the loss's backward: the gradient of the output and temporaries."""
    held_bytes: int = 0
    """Bytes live through the model's whole backward: the loss itself and the gradient autograd seeds
    the backward with (a float32 scalar loss: 8 bytes; without them a lowest plan measured 8 bytes over
    its prediction and could not be planned at its own lowest peak)."""


@dataclass(frozen=True)
class CompiledGraph:
    """An ActivationGraph of a joint graph, and the FX nodes behind its storages."""

    graph: ActivationGraph
    producers: dict[str, fx.Node]
    """Storage name -> the forward FX node whose value it is (the base of any views)."""
    always_saved: tuple[fx.Node, ...]
    """Forward values every partition must save: random draws (NOTE [random operators] in
    groups.py)."""
    storage_of: dict[fx.Node, str] = field(repr=False)
    """Forward FX node -> the activation storage its value lives in (views: their base's)."""
    backward: tuple[fx.Node, ...] = field(repr=False)
    """The joint graph's backward operators, in the order autograd ran them."""
    kernel_order: tuple[str, ...] = field(repr=False)
    """Names of the backward operators that allocate, in the order the plan runs them (NOTE
    [backward order]); `order_backward` imposes it on the partitioned backward graph."""
    kernel_steps: dict[str, int] = field(repr=False, default_factory=dict)
    """Backward operator name -> the graph node whose backward step it runs in (NOTE [horizontal
    fusion] in optimize.py)."""


def _op_label(node: fx.Node) -> str:
    original = node.meta.get("original_aten")
    return str(original.overloadpacket.__name__) if original is not None else target_name(node)


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module call `node` belongs to ("" for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    qualified = list(stack.values())[-1][0]
    return MODULES_ACCESS.sub(r".\1", MODULE_PREFIX.sub("", qualified)).lstrip(".")


def _flops(node: fx.Node) -> int:
    """FLOPs of `node` by `torch.utils.flop_counter`'s formulas on its fake values (0 if uncounted)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket not in flop_registry:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    return int(flop_registry[target.overloadpacket](*args, **kwargs, out_val=node.meta.get("val")))


def _group_node(
    reader: JointReader, group: Sequence[fx.Node], backward: Backward, spec: DeviceSpec, *, pinned: bool
) -> Node:
    """The graph node of one group; a `pinned` group (the front one) is never checkpointed."""
    creates = [
        name for node in group if (name := reader.made_here(node)) and reader.forward_materialized(name)
    ]
    kernels = [node for node in group if (name := reader.made_here(node)) and name in creates]
    reads = sorted(frozenset().union(*(reader.reads(node) for node in kernels)) - set(creates))
    sizes = reader.storages.sizes
    moved_bytes = sum(sizes[name] for name in (*creates, *reads))
    flops = sum(_flops(node) for node in group)
    random = any(is_random(node, reader.op_types) for node in group)
    forward_ms = analytic_forward_ms(flops, moved_bytes, spec, random=random) if kernels else 0.0
    head = next((node for node in group if node.meta.get("seq_nr") is not None), group[0])
    return Node(
        name=head.name,
        op=_op_label(head),
        module_path=module_path(head),
        inputs=tuple(reads),
        creates=tuple(creates),
        reads=tuple(reads),
        saves=tuple(sorted(backward.saves)),
        saves_anything=bool(backward.saves),
        forward_ms=forward_ms,
        backward_ms=BACKWARD_FACTOR * forward_ms if backward.runs else 0.0,
        forward_workspace_bytes=max((reader.scratch_bytes.get(node, 0) for node in kernels), default=0),
        backward_workspace_bytes=backward.workspace_bytes,
        replay_workspace_bytes=backward.replay_workspace_bytes,
        backward_points=backward.release_points(),
        parameter_gradient_bytes=backward.gradient_bytes,
        keep_cache_bytes=sum(sizes[name] for name in creates),
        forward_flops=flops,
        moved_bytes=moved_bytes,
        operator_count=len(kernels),
        random=random,
        checkpointable=not pinned and checkpointable_group(group, reader.op_types),
    )


def _layout_copy_node(reader: JointReader) -> Node:
    """NOTE [layout copies]: the copies inductor makes first, kept until their convolutions' backward."""
    copies = tuple(sorted(reader.layout_copies.values()))
    copied_bytes = sum(reader.storages.sizes[name] for name in copies)
    return Node(
        name=LAYOUT_COPY_NODE,
        op="channels-last copy",
        module_path="",
        inputs=(),
        creates=copies,
        reads=(),
        saves=(),
        saves_anything=False,
        forward_ms=0.0,
        backward_ms=0.0,
        forward_workspace_bytes=0,
        backward_workspace_bytes=0,
        keep_cache_bytes=copied_bytes,
        moved_bytes=2 * copied_bytes,
        checkpointable=False,
    )


def _loss_node(reader: JointReader, loss: LossProfile) -> tuple[Node, dict[str, int]]:
    """The loss, run eagerly on the model's output after the compiled forward."""
    saved = [f"{LOSS_NODE}.saved"] if loss.saved_bytes else []
    outputs = sorted(reader.output_storages)
    node = Node(
        name=LOSS_NODE,
        op=LOSS_NODE,
        module_path="",
        inputs=tuple(outputs),
        creates=tuple(saved),
        reads=tuple(outputs),
        saves=tuple(saved),
        saves_anything=bool(saved),
        forward_ms=0.0,
        backward_ms=0.0,
        forward_workspace_bytes=loss.forward_workspace_bytes,
        backward_workspace_bytes=loss.backward_workspace_bytes,
        checkpointable=False,
    )
    return node, {name: loss.saved_bytes for name in saved}


def build_compiled_graph(
    joint: fx.GraphModule,
    node_info: NodeInfo,
    default_saved: Iterable[fx.Node],
    *,
    num_fwd_outputs: int,
    static: StaticBytes,
    loss: LossProfile,
    spec: DeviceSpec,
    optimizer: str,
) -> CompiledGraph:
    """The ActivationGraph of the compiled step whose joint graph is `joint`.

    `default_saved` is the partition without checkpointing (inductor's min-cut at budget 1.0): what a
    STORE region saves. `static` and `loss` come from the model, measured outside the graph.
    """
    reader = JointReader(joint, node_info, default_saved, num_fwd_outputs)
    draws = random_draws(reader.forward, reader.op_types)
    front_set = {*draws, *reader.step_constants}
    front = [node for node in reader.forward if node in front_set]
    groups = place_hoisted(operator_groups(reader.forward, front), reader.hoisted)
    order = backward_order(reader)
    backward = backward_by_group(reader, groups, order, loss.held_bytes)
    nodes = [
        _group_node(reader, group, entry, spec, pinned=bool(front) and index == 0)
        for index, (group, entry) in enumerate(zip(groups, backward, strict=True))
    ]
    if reader.layout_copies:
        nodes.insert(0, _layout_copy_node(reader))
    loss_node, loss_storages = _loss_node(reader, loss)
    used = {name for node in nodes for name in (*node.creates, *node.reads, *node.saves)}
    storage_bytes = {name: reader.storages.sizes[name] for name in sorted(used)} | loss_storages
    gradient_bytes = sum(node.parameter_gradient_bytes for node in nodes)
    graph = ActivationGraph(
        nodes=(*nodes, loss_node),
        storage_bytes=storage_bytes,
        static=dataclasses.replace(static, gradient_bytes=gradient_bytes),
        capture=f"{COMPILED_CAPTURE} (inductor joint graph, {len(reader.forward)} forward operators)",
        optimizer=optimizer,
        timing=f"analytic ({spec.name})",
        memory_counting=current_counting(),
    )
    return CompiledGraph(
        graph=graph,
        producers={name: reader.storages.producer[name] for name in used if name in reader.storages.producer},
        always_saved=tuple(node for node in draws if is_random(node, reader.op_types)),
        storage_of={
            node: name for node in reader.forward_set if (name := reader.activation(node)) is not None
        },
        backward=tuple(reader.backward),
        kernel_order=tuple(kernel.node.name for kernel in order),
        kernel_steps={name: index for index, entry in enumerate(backward) for name in entry.kernels},
    )


def _must_save(node: fx.Node, op_types: OpTypes) -> bool:
    """Forward values a partition must save rather than recompute: RNG state that recomputing would not
    replay (NOTE [random operators] in groups.py), symbolic sizes, and what the partitioner
    itself pins to the forward (collectives, effectful operators, sources of mutations in backward)."""
    from torch._functorch.partitioners import _must_be_in_forward, is_sym_node
    from torch.utils.checkpoint import CheckpointPolicy

    replayable = target_name(node) in REPLAYABLE_RANDOM
    return (
        (is_random(node, op_types) and not replayable)
        or is_sym_node(node)
        or node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
        or _must_be_in_forward(node)
    )


def saved_values(compiled: CompiledGraph, retained: Iterable[str]) -> list[fx.Node]:
    """The forward values a partition saves so that the backward keeps the storages `retained` (as a
    schedule holds them) and recomputes everything else it needs.

    Walks back from every backward operator: a value whose storage is retained is saved (its base, for
    a view); a parameter or input is saved (it costs nothing: it is alive anyway); RNG state and the
    like are saved (`_must_save`); any other forward value is recomputed from its own inputs.
    """
    op_types = get_default_op_list()
    retained_set = set(retained)
    saved: dict[fx.Node, None] = dict.fromkeys(compiled.always_saved)
    saved.update(
        dict.fromkeys(compiled.producers[name] for name in retained_set if name in compiled.producers)
    )
    backward = set(compiled.backward)
    visited: set[fx.Node] = set()
    pending = [source for node in compiled.backward for source in node.all_input_nodes]
    while pending:
        node = pending.pop()
        if node in visited or node in saved or node in backward:
            continue
        visited.add(node)
        if node.op == "placeholder":
            if is_primal(node):
                saved[node] = None
        elif compiled.storage_of.get(node) in retained_set:
            saved[compiled.producers[compiled.storage_of[node]]] = None
        elif _must_save(node, op_types):
            saved[node] = None
        else:
            pending += node.all_input_nodes
    return list(saved)


def retained_storages(graph: ActivationGraph, schedule: Schedule) -> set[str]:
    """Storages `schedule` keeps from forward to backward: what its stored nodes save, the inputs of its
    checkpointed regions, and the outputs of the nodes they keep (selective keeps)."""
    retained: set[str] = set()
    for region in schedule.regions:
        retained |= set(held_storages(graph, region))
        retained |= {name for index in region.keep for name in graph.nodes[index].creates}
    return retained
