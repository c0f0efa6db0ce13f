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
  a liveness pass over the joint graph's backward, in the order autograd ran it, and become each node's
  backward workspace and parameter gradients (NOTE [measured residuals] in ir.py, here predicted);
- times are analytic (FLOPs and bytes on a roofline, profile.py): the compiled kernels do not exist yet
  when the partitioner runs.

NOTE [layout copies]: on the CPU (mkldnn) inductor runs convolutions in channels-last and copies
every parameter and graph input a convolution reads that is not channels-last already (a 3x3 weight,
the image) at the start of the forward; the backward's convolutions read the copies, so they are
saved. No operator of the joint graph makes them: they are storages of a node of their own, first,
which no plan checkpoints, and each convolution's node reads and saves its copies.

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

from planner.compiled.backward_order import Kernel, least_peak_first, peak_of_order
from planner.compiled.fusion import FusionModel, Storages, addmm_folds, is_primal, node_tensor, target_name
from planner.compiled.groups import (
    REPLAYABLE_RANDOM,
    checkpointable_group,
    hoisted_operators,
    is_random,
    operator_groups,
    place_hoisted,
    random_draws,
    step_constants,
)
from planner.compiled.kernel_scratch import scratch_bytes
from planner.ir import ActivationGraph, Node, Schedule, StaticBytes
from planner.profiler.cost_model import BACKWARD_FACTOR, DeviceSpec, analytic_forward_ms
from planner.profiler.interpreter import LOSS_NODE
from planner.profiler.measurement import counted_bytes, current_counting
from planner.simulation.step import held_storages

__all__ = ["CompiledGraph", "LossProfile", "build_compiled_graph"]

LOSS_HELD = "loss.held"
"""The backward's pseudo-buffer for `LossProfile.held_bytes`."""
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


def _layout_optimised(joint: fx.GraphModule) -> bool:
    """Whether inductor runs `joint`'s convolutions in channels-last (NOTE [layout copies])."""
    from torch._inductor.graph import GraphLowering

    return bool(GraphLowering.decide_layout_opt(joint, is_inference=False))


def _layout_copies(forward: Sequence[fx.Node], storages: Storages) -> dict[str, str]:
    """NOTE [layout copies]: storage of each parameter or input a convolution reads that inductor
    copies to channels-last -> the copy's storage name (sized in `storages`)."""
    copies: dict[str, str] = {}
    for node in forward:
        if node.target is not torch.ops.aten.convolution.default:
            continue
        for source in node.args[:2]:
            if not isinstance(source, fx.Node) or source.op != "placeholder":
                continue
            value = node_tensor(source)
            if value is None or value.dim() != 4:
                continue
            if value.is_contiguous(memory_format=torch.channels_last):
                continue
            name = storages.name(source)
            if name is not None and name not in copies:
                copies[name] = f"{name}.channels_last"
                storages.sizes[copies[name]] = counted_bytes(value.untyped_storage().nbytes())
                storages.dtypes[copies[name]] = value.dtype
    return copies


class _JointReader:
    """One pass over a joint graph: storages, groups, what each group's backward reads, liveness."""

    def __init__(
        self,
        joint: fx.GraphModule,
        node_info: NodeInfo,
        default_saved: Iterable[fx.Node],
        num_fwd_outputs: int,
    ) -> None:
        self.op_types = get_default_op_list()
        self.storages = Storages(self.op_types)
        nodes = list(joint.graph.nodes)
        named = {node: self.storages.name(node) for node in nodes}  # in graph order: producers first
        self.static_storages = {name for node, name in named.items() if is_primal(node) and name is not None}
        self.forward = [n for n in nodes if n.op == "call_function" and node_info.is_required_fw(n)]
        self.hoisted = hoisted_operators(self.forward, default_saved)
        self.forward_set = {*self.forward, *self.hoisted}
        self.backward = [n for n in nodes if n.op == "call_function" and n not in self.forward_set]
        self.backward_set = set(self.backward)
        output = next(n for n in nodes if n.op == "output")
        values = [value for value in output.args[0] if isinstance(value, fx.Node)]
        self.forward_outputs = set(output.args[0][:num_fwd_outputs]) - {None}
        primals = [node for node in nodes if is_primal(node)]
        gradients_of_primals = output.args[0][num_fwd_outputs:]
        with_gradient = [p for p, g in zip(primals, gradients_of_primals, strict=True) if g is not None]
        self.step_constants = step_constants(self.forward, with_gradient, self.op_types)
        """NOTE [step constants] in groups.py."""
        self.gradients = set(values) - self.forward_outputs
        self.tangents = [n for n in nodes if n.op == "placeholder" and not is_primal(n)]
        self.gradient_dependent = set(node_info.tangents_closure)
        self.tangent_storages = {
            name for node in self.tangents if (name := self.storages.name(node)) is not None
        }
        channels_last = _layout_optimised(joint)
        self.layout_copies = _layout_copies(self.forward, self.storages) if channels_last else {}
        self.scratch_bytes = scratch_bytes((*self.forward, *self.backward), channels_last=channels_last)
        """NOTE [kernel scratch]: bytes an extern kernel holds above its outputs while it runs."""
        self.saved_storages = self._activation_storages(default_saved) | set(self.layout_copies.values())
        self.output_storages = self._activation_storages(self.forward_outputs)
        self.releasable_saved = self.saved_storages - self.output_storages
        """Saved storages the backward may free or reuse once read: not those the forward also returns
        (NOTE [saved outputs])."""
        self._saved_closure: dict[fx.Node, frozenset[str]] = {}
        pinned = set(self.step_constants)
        read_constants = self._activation_storages(
            node for node in pinned if any(user not in pinned for user in node.users)
        )
        kept = self.saved_storages | self.output_storages | read_constants
        self.forward_fusion = FusionModel(
            [n for n in nodes if n in self.forward_set],
            self.op_types,
            self.storages.name,
            self._placeholder_storage,
            lambda node: self.activation(node) in kept and self.made_here(node) is not None,
        )
        self.backward_fusion = FusionModel(
            self.backward,
            self.op_types,
            self.storages.name,
            lambda node: (
                self.saved_reads(node) if node in self.forward_set else self._placeholder_storage(node)
            ),
            lambda node: node in self.gradients,
            addmm_folds(self.backward),
        )

    def _placeholder_storage(self, node: fx.Node) -> frozenset[str]:
        """A parameter or input as kernels read it: its channels-last copy where inductor makes one."""
        name = self.storages.name(node) if node.op == "placeholder" else None
        if name is None:
            return frozenset()
        return frozenset({self.layout_copies.get(name, name)})

    def _activation_storages(self, nodes: Iterable[fx.Node]) -> set[str]:
        names = {self.storages.name(node) for node in nodes if isinstance(node, fx.Node)}
        return {name for name in names if name is not None and name not in self.static_storages}

    def activation(self, node: fx.Node) -> str | None:
        """The activation storage of a forward value (None for parameters, inputs and non-tensors)."""
        name = self.storages.name(node)
        return None if name is None or name in self.static_storages else name

    def made_here(self, node: fx.Node) -> str | None:
        """The storage `node` allocates, if it allocates one (not a view of another value's)."""
        name = self.activation(node)
        return name if name is not None and self.storages.producer[name] is node else None

    def forward_materialized(self, name: str) -> bool:
        return self.storages.producer[name] in self.forward_fusion.materialized

    def reads(self, node: fx.Node) -> frozenset[str]:
        """Activation storages the kernel computing `node` reads (NOTE [fusion model] in
        fusion.py): a value computed inside the kernel contributes what it reads in turn."""
        return frozenset(
            name for name in self.forward_fusion.inlined_reads[node] if name not in self.static_storages
        )

    def saved_reads(self, node: fx.Node) -> frozenset[str]:
        """Saved storages (of the partition without checkpointing) a backward use of `node` needs: its
        storage when saved (a view of a saved value reads its base), else, for a forward value, what
        recomputing it reads; nothing for a value the backward made."""
        if node in self._saved_closure:
            return self._saved_closure[node]
        name = self.activation(node)
        if name is None:
            found: frozenset[str] = frozenset()
        elif name in self.saved_storages:
            found = frozenset({name})
        elif node not in self.forward_set:
            found = frozenset()
        else:
            found = frozenset().union(*(self.saved_reads(source) for source in node.all_input_nodes))
        self._saved_closure[node] = found
        return found

    def backward_buffer(self, node: fx.Node) -> str | None:
        """The buffer a backward node (or a tangent) allocates, per NOTE [fusion model]; None when it
        computes inside another kernel, is a view, or is not a tensor."""
        name = self.storages.name(node)
        if name is None or self.storages.producer[name] is not node:
            return None
        if node.op == "placeholder" or node in self.backward_fusion.materialized:
            return name
        return None


@dataclass
class _Backward:
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


def _kernels(reader: _JointReader) -> list[Kernel]:
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


def _freeable_inputs(reader: _JointReader, kernels: Sequence[Kernel]) -> dict[str, int]:
    """Storages the backward receives and frees after their last reader: saved activations, tangents."""
    made = {kernel.buffer for kernel in kernels}
    return {
        name: reader.storages.sizes[name]
        for kernel in kernels
        for name in kernel.reads
        if name not in made and (name in reader.releasable_saved or name in reader.tangent_storages)
    }


def backward_order(reader: _JointReader) -> list[Kernel]:
    """NOTE [backward order]."""
    kernels = _kernels(reader)
    inputs = _freeable_inputs(reader, kernels)
    memory_first = least_peak_first(kernels, inputs)
    return min((kernels, memory_first), key=lambda order: peak_of_order(order, inputs))


def _backward_by_group(
    reader: _JointReader, groups: list[list[fx.Node]], order: Sequence[Kernel], held_bytes: int
) -> list[_Backward]:
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
    backward = [_Backward() for _ in groups]
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


def _reusable(reader: _JointReader, name: str, live: dict[str, int]) -> bool:
    """Whether a kernel may write its output into dying `name` (NOTE [buffer reuse]): a buffer the
    backward made, or a saved value the forward does not also return; never a tangent, which autograd
    holds until the backward returns (NOTE [saved outputs])."""
    made_by_backward = name in live and name not in reader.tangent_storages
    return made_by_backward or name in reader.releasable_saved


def _same_buffer(reader: _JointReader, first: str, second: str) -> bool:
    """Whether inductor may reuse storage `first` for `second` (NOTE [buffer reuse])."""
    storages = reader.storages
    return (
        storages.sizes[first] == storages.sizes[second] and storages.dtypes[first] == storages.dtypes[second]
    )


def _group_node(
    reader: _JointReader, group: Sequence[fx.Node], backward: _Backward, spec: DeviceSpec, *, pinned: bool
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


def _layout_copy_node(reader: _JointReader) -> Node:
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


def _loss_node(reader: _JointReader, loss: LossProfile) -> tuple[Node, dict[str, int]]:
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
    reader = _JointReader(joint, node_info, default_saved, num_fwd_outputs)
    draws = random_draws(reader.forward, reader.op_types)
    front_set = {*draws, *reader.step_constants}
    front = [node for node in reader.forward if node in front_set]
    groups = place_hoisted(operator_groups(reader.forward, front), reader.hoisted)
    order = backward_order(reader)
    backward = _backward_by_group(reader, groups, order, loss.held_bytes)
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
        capture=f"torch.compile (inductor joint graph, {len(reader.forward)} forward operators)",
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
