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
- storages are the buffers inductor materialises (NOTE [fusion model]), sized from the graph's fake
  tensors; views share their base's storage;
- what a node "saves" is what its backward reads of the partition without checkpointing (inductor's
  own min-cut partition at activation_memory_budget=1.0), following recomputed values back to saved
  ones; a checkpointed region of a plan keeps its inputs instead and its backward recomputes the rest;
- the backward's own buffers (gradients in flight) and the parameter gradients it returns are found by
  a liveness pass over the joint graph's backward, in the order autograd ran it, and become each node's
  backward workspace and parameter gradients (NOTE [measured residuals] in ir.py, here predicted);
- times are analytic (FLOPs and bytes on a roofline, profile.py): the compiled kernels do not exist yet
  when the partitioner runs.

NOTE [fusion model]: a forward or backward value is materialised (allocated as a buffer) when it is a
graph output (a saved value, the model's output, a gradient), when the operator that makes it is not
fusible (matmuls, convolutions: extern kernels), or when an operator that is not fusible reads it.
Every other value is computed inside the kernel that consumes it. This is the partitioner's own notion
(`is_materialized` in torch/_functorch/partitioners.py, over `get_default_op_list()`); inductor's
scheduler may still fuse or reuse more, which tests measure against the compiled step's real peak.

NOTE [addmm]: after partitioning, inductor's post-grad pass rewrites `add(mm(a, b), c)` into one
`addmm(c, a, b)` where the mm has no other user (`addmm` in torch/_inductor/fx_passes/post_grad.py).
In a backward that sums two gradients of one tensor (an input embedding tied to the language-model
head: the head's weight gradient `mm(grad_logits.T, h)` plus the embedding's scatter), the mm then
runs where the add runs, at the very end, and the logits' gradient it reads stays allocated until
then. The backward's fusion model folds such an mm into its add (`_addmm_folds`): the add is a kernel
of its own that reads the mm's inputs, and the mm makes no buffer. A three-layer language model with
tied weights measured 2 MiB (the logits' gradient) above its prediction without this; GPT-2 ties its
weights the same way.

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

NOTE [random operators]: on the CPU inductor turns dropout into `inductor_random(seed)` with seeds drawn
once per step by `inductor_seeds`. A value recomputed from the same seed is the same value, so random
operators may be recomputed, provided the seeds tensor is saved: it is its own node at the front of the
graph (where inductor allocates it), never checkpointed, and every plan saves it. Any other random
operator (`aten.rand`, `bernoulli` under `fallback_random`) would draw new numbers when recomputed, so
the node holding it is not checkpointable: its outputs are always saved.

NOTE [step constants]: some forward values depend on no primal that needs a gradient and on no random
draw: a causal mask built by comparing position indices, rotary cos/sin tables, position ids. AOT
autograd gives them the sequence number of the differentiable operator before them (Llama's: the
embedding's), and inductor computes them inside every kernel that reads them, per element of that
kernel. A plan that recomputes them rebuilds them in each recomputed kernel: Llama's `ilp` plan that
started a checkpointed region at the embedding spent 1.7 ms of a 13 ms step rebuilding the mask with
index and compare operations inside its softmax kernels, where the roofline priced the group at
0.013 ms (bench/kernel_time.py). So a constant that a non-constant operator reads, and whose
computation does arithmetic (an operator other than a fill, a copy, a view or `iota`), joins the
front group with the constants it is computed from: it is never checkpointed, it is materialised
once, and a checkpointed region that needs it holds it as one of its inputs (the partition saves it).
That plan's step went from 1.084x compiled no checkpointing to 1.003x. A constant made only of fills
and copies (a `full` of zeros, shifted labels) stays where it is: inductor inlines it for free. The
outputs of a frozen module on the inputs qualify too, and are never recomputed. The bytes are
counted, from the start of the forward; the value is materialised in the model's forward even in a
plan that saves it for no region (inductor then inlines it again, so the prediction over-counts it
briefly, by its size).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._functorch.partitioners import NodeInfo, OpTypes, get_default_op_list
from torch.utils.flop_counter import flop_registry

from planner.backward_order import Kernel, least_peak_first, peak_of_order
from planner.cost_model import BACKWARD_FACTOR, DeviceSpec, analytic_forward_ms
from planner.ir import ActivationGraph, Node, Schedule, StaticBytes
from planner.kernel_scratch import scratch_bytes
from planner.simulate import held_storages

__all__ = ["CompiledGraph", "LossProfile", "build_compiled_graph", "SEEDS_NODE"]

SEEDS_NODE = "inductor_seeds"
LOSS_NODE = "loss"
LOSS_HELD = "loss.held"
"""The backward's pseudo-buffer for `LossProfile.held_bytes`."""
LAYOUT_COPY_NODE = "channels_last_copies"
REPLAYABLE_RANDOM = {"inductor_random", "inductor_lookup_seed"}
"""Random operators that inductor computes from a saved seed: recomputing them replays the same numbers."""
FREE_CONSTANT_OPS = frozenset(
    {"full", "scalar_tensor", "iota", "clone", "convert_element_type", "_to_copy", "copy"}
    | {"constant_pad_nd", "cat", "empty", "zeros", "ones", "new_empty", "new_zeros", "new_ones"}
)
"""Operators that fill or copy: a step constant computed by these alone costs nothing to inline (NOTE
[step constants])."""
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
    """Forward values every partition must save: random draws (NOTE [random operators])."""
    storage_of: dict[fx.Node, str] = field(repr=False)
    """Forward FX node -> the activation storage its value lives in (views: their base's)."""
    backward: tuple[fx.Node, ...] = field(repr=False)
    """The joint graph's backward operators, in the order autograd ran them."""
    kernel_order: tuple[str, ...] = field(repr=False)
    """Names of the backward operators that allocate, in the order the plan runs them (NOTE
    [backward order]); `order_backward` imposes it on the partitioned backward graph."""
    kernel_steps: dict[str, int] = field(repr=False, default_factory=dict)
    """Backward operator name -> the graph node whose backward step it runs in (NOTE [horizontal
    fusion] in compiled.py)."""


def _is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" not in str(node.target)


def _tensor(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _target_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0] if isinstance(target, torch._ops.OpOverload) else name


def _op_label(node: fx.Node) -> str:
    original = node.meta.get("original_aten")
    return str(original.overloadpacket.__name__) if original is not None else _target_name(node)


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module call `node` belongs to ("" for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    qualified = list(stack.values())[-1][0]
    return MODULES_ACCESS.sub(r".\1", MODULE_PREFIX.sub("", qualified)).lstrip(".")


def _is_random(node: fx.Node, op_types: OpTypes) -> bool:
    """Whether `node` draws random numbers: aten's `nondeterministic_seeded` operators (dropout,
    bernoulli, rand), the partitioner's random list, and inductor's seeds and random prims."""
    target = node.target
    seeded = isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
    return seeded or op_types.is_random(node) or _target_name(node) in (SEEDS_NODE, *REPLAYABLE_RANDOM)


class _Storages:
    """Storage names of tensor values (views share their base's), and which are materialised."""

    def __init__(self, op_types: OpTypes) -> None:
        self.op_types = op_types
        self.name_of_key: dict[int, str] = {}
        self.sizes: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.producer: dict[str, fx.Node] = {}

    def name(self, node: fx.Node) -> str | None:
        """The storage of `node`'s value, named after the first node that made it (None: no tensor)."""
        tensor = _tensor(node)
        if tensor is None or tensor.untyped_storage().nbytes() == 0:
            return None
        key = _storage_key(tensor)
        if key not in self.name_of_key:
            self.name_of_key[key] = node.name
            self.sizes[node.name] = tensor.untyped_storage().nbytes()
            self.dtypes[node.name] = tensor.dtype
            self.producer[node.name] = node
        return self.name_of_key[key]


REALIZE_READS = 4
"""inductor's `realize_reads_threshold`: a value read by several kernels is stored once it reads more."""
REALIZE_ACCUMULATED_READS = 8
"""inductor's `realize_acc_reads_threshold`: a value whose inlined computation reads more is stored."""
HEAVY_OPS = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})
"""On the CPU inductor stores a value used by several kernels whose computation includes one of these."""


class _FusionModel:
    """NOTE [fusion model], applied to one part of the joint graph (forward or backward) in order.

    For every node: whether its value is stored (`materialized`), and the storages the kernel that
    computes it reads (`inlined_reads`: through the values it computes inline, down to stored ones).
    `outside(node)` names the storages a value from outside the part stands for (a parameter itself;
    for the backward, the saved activations a forward value is recomputed from).
    """

    def __init__(
        self,
        nodes: Sequence[fx.Node],
        op_types: OpTypes,
        storage: Callable[[fx.Node], str | None],
        outside: Callable[[fx.Node], frozenset[str]],
        outputs: Callable[[fx.Node], bool],
        addmm: Mapping[fx.Node, fx.Node] | None = None,
    ) -> None:
        self.op_types = op_types
        self.addmm = dict(addmm or {})
        """NOTE [addmm]: the add an mm's value is computed inside -> that mm."""
        self.folded = set(self.addmm.values())
        self.materialized: set[fx.Node] = set()
        self.inlined_reads: dict[fx.Node, frozenset[str]] = {}
        self.inlined_ops: dict[fx.Node, frozenset[str]] = {}
        part = set(nodes)
        for node in nodes:
            reads: set[str] = set()
            ops = {_target_name(node)}
            for source in node.all_input_nodes:
                if source not in part:
                    reads |= outside(source)
                elif source in self.materialized:
                    reads.add(storage(source) or source.name)
                else:
                    reads |= self.inlined_reads[source]
                    ops |= self.inlined_ops[source]
            self.inlined_reads[node] = frozenset(reads)
            self.inlined_ops[node] = frozenset(ops)
            if not op_types.is_view(node) and self._stored(node, part, outputs(node), reads, ops):
                self.materialized.add(node)

    def _stored(
        self, node: fx.Node, part: set[fx.Node], is_output: bool, reads: set[str], ops: set[str]
    ) -> bool:
        if _tensor(node) is None or node in self.folded:
            return False
        if node in self.addmm:
            return True
        # one output of a multi-output operator (var_mean) is stored as that operator would be
        operator_node = node.args[0] if node.target is operator.getitem else node
        assert isinstance(operator_node, fx.Node)
        if is_output or not self.op_types.is_fusible(operator_node) or _is_reduction(operator_node, node):
            return True
        users = _users_through_views(node, self.op_types, part)
        if any(
            user.op == "output" or user in self.addmm or not self.op_types.is_fusible(user) for user in users
        ):
            return True
        if len(set(node.users)) > 1 and (ops & HEAVY_OPS or len(reads) > REALIZE_READS):
            return True
        return len(reads) > REALIZE_ACCUMULATED_READS


def _addmm_folds(nodes: Sequence[fx.Node]) -> dict[fx.Node, fx.Node]:
    """NOTE [addmm]: each `add(mm(a, b), c)` (either order) of `nodes` that inductor's post-grad pass
    turns into `addmm(c, a, b)` -> its mm: the mm's only user is the add, and `c` is a tensor of the
    mm's dtype that expands to its shape (`is_valid_addmm_fusion` in torch/_inductor/fx_passes/
    post_grad.py; on a GPU, an add whose users are all pointwise stays unfused, and is left here)."""
    part = set(nodes)
    folds: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.target is not torch.ops.aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        value = _tensor(node)
        if value is None or (value.device.type != "cpu" and all(_pointwise(user) for user in node.users)):
            continue
        for mm, other in (node.args, node.args[::-1]):
            if not (isinstance(mm, fx.Node) and mm in part and mm.target is torch.ops.aten.mm.default):
                continue
            if len(mm.users) != 1 or not isinstance(other, fx.Node):
                continue
            product, addend = _tensor(mm), _tensor(other)
            operands = [_tensor(source) for source in mm.all_input_nodes]
            if product is None or addend is None or any(operand is None for operand in operands):
                continue
            dtypes = {addend.dtype, *(operand.dtype for operand in operands if operand is not None)}
            if len(dtypes) == 1 and _expands_to(addend.shape, product.shape):
                folds[node] = mm
                break
    return folds


def _expands_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _users_through_views(node: fx.Node, op_types: OpTypes, part: set[fx.Node]) -> list[fx.Node]:
    """Users of `node` in `part` (or the graph output), looking through views to the views' users."""
    found: list[fx.Node] = []
    pending = [node]
    while pending:
        current = pending.pop()
        for user in current.users:
            if user in part and op_types.is_view(user):
                pending.append(user)
            elif user in part or user.op == "output":
                found.append(user)
    return found


def _is_reduction(operator_node: fx.Node, value: fx.Node) -> bool:
    """Whether `value` (of `operator_node`) has fewer elements than an input: a reduction's own loop."""
    output = _tensor(value)
    inputs = [t for source in operator_node.all_input_nodes if (t := _tensor(source)) is not None]
    return output is not None and any(t.numel() > output.numel() for t in inputs)


def _flops(node: fx.Node) -> int:
    """FLOPs of `node` by `torch.utils.flop_counter`'s formulas on its fake values (0 if uncounted)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket not in flop_registry:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    return int(flop_registry[target.overloadpacket](*args, **kwargs, out_val=node.meta.get("val")))


def _random_draws(forward: Sequence[fx.Node], op_types: OpTypes) -> list[fx.Node]:
    """Forward nodes that draw random numbers from nothing the step computes (inductor's seeds, the
    `bernoulli_` a Dropout2d fills a fresh tensor with), with the nodes they draw into, in order: NOTE
    [random operators]."""
    found: set[fx.Node] = set()
    for node in forward:
        if not _is_random(node, op_types) or _target_name(node) in REPLAYABLE_RANDOM:
            continue
        draw, pending = {node}, list(node.all_input_nodes)
        while pending:
            source = pending.pop()
            if source.op == "placeholder" or source in draw:
                continue
            draw.add(source)
            pending += source.all_input_nodes
        if all(source.op == "placeholder" or source in draw for n in draw for source in n.all_input_nodes):
            found |= draw
    return [node for node in forward if node in found]


def _step_constants(
    forward: Sequence[fx.Node], with_gradient: Iterable[fx.Node], op_types: OpTypes
) -> list[fx.Node]:
    """Forward nodes that compute a step constant by arithmetic for a non-constant operator to read,
    with the constants it is computed from, in order (NOTE [step constants]). `with_gradient`: the
    primals the joint graph returns a gradient for."""
    varying = set(with_gradient)
    constants: list[fx.Node] = []
    for node in forward:
        if _is_random(node, op_types) or any(source in varying for source in node.all_input_nodes):
            varying.add(node)
        else:
            constants.append(node)
    constant_set = set(constants)
    pinned: set[fx.Node] = set()
    for node in constants:
        tensor = _tensor(node)
        if tensor is None or tensor.numel() <= 1 or all(user in constant_set for user in node.users):
            continue
        cone = _constant_cone(node, constant_set)
        if any(not op_types.is_view(n) and _target_name(n) not in FREE_CONSTANT_OPS for n in cone):
            pinned |= cone
    return [node for node in constants if node in pinned]


def _constant_cone(node: fx.Node, constants: set[fx.Node]) -> set[fx.Node]:
    """`node` and the constants it is computed from."""
    cone: set[fx.Node] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if current in cone:
            continue
        cone.add(current)
        pending += [source for source in current.all_input_nodes if source in constants]
    return cone


def _groups(forward: Sequence[fx.Node], front: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """Forward nodes grouped by the eager operator they decompose (autograd's `seq_nr`), in order.

    Nodes without a sequence number (the random operators inductor substitutes for dropout, views it
    adds) join the next group that has one. `front` (the random draws, NOTE [random operators]; the
    step constants, NOTE [step constants]) is a group of its own, first.
    """
    front_set = set(front)
    groups: list[list[fx.Node]] = [list(front)] if front else []
    pending: list[fx.Node] = []
    current_seq: object = None
    for node in forward:
        if node in front_set:
            continue
        seq = node.meta.get("seq_nr")
        if seq is None:
            pending.append(node)
            continue
        if len(groups) > bool(front) and seq == current_seq:
            groups[-1] += [*pending, node]
        else:
            groups.append([*pending, node])
        pending = []
        current_seq = seq
    if pending:
        if len(groups) > bool(front):
            groups[-1] += pending
        else:
            groups.append(pending)
    return groups


def _hoisted(forward: Sequence[fx.Node], default_saved: Iterable[fx.Node]) -> list[fx.Node]:
    """Backward operators that do not depend on the gradient (a transpose of a saved value, a LayerNorm
    backward's scale), which the partition computes at the end of the forward and saves, with the
    gradient-free operators they need, in graph order."""
    required = set(forward)
    found: set[fx.Node] = set()
    pending = [node for node in default_saved if node.op == "call_function" and node not in required]
    while pending:
        node = pending.pop()
        if node in found:
            continue
        found.add(node)
        pending += [n for n in node.all_input_nodes if n.op == "call_function" and n not in required]
    order = {node: index for index, node in enumerate(next(iter(forward)).graph.nodes)} if forward else {}
    return sorted(found, key=order.__getitem__)


def _place_hoisted(groups: list[list[fx.Node]], hoisted: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """Add each hoisted backward operator to the group of the forward operator it differentiates (the
    same `seq_nr`), else to the latest group among its inputs'."""
    group_of = {node: index for index, group in enumerate(groups) for node in group}
    group_of_seq = {node.meta.get("seq_nr"): index for node, index in group_of.items()}
    for node in hoisted:
        index = group_of_seq.get(node.meta.get("seq_nr"))
        if index is None:
            index = max((group_of[n] for n in node.all_input_nodes if n in group_of), default=len(groups) - 1)
        groups[index].append(node)
        group_of[node] = index
    return groups


def _layout_optimised(joint: fx.GraphModule) -> bool:
    """Whether inductor runs `joint`'s convolutions in channels-last (NOTE [layout copies])."""
    from torch._inductor.graph import GraphLowering

    return bool(GraphLowering.decide_layout_opt(joint, is_inference=False))


def _layout_copies(forward: Sequence[fx.Node], storages: _Storages) -> dict[str, str]:
    """NOTE [layout copies]: storage of each parameter or input a convolution reads that inductor
    copies to channels-last -> the copy's storage name (sized in `storages`)."""
    copies: dict[str, str] = {}
    for node in forward:
        if node.target is not torch.ops.aten.convolution.default:
            continue
        for source in node.args[:2]:
            if not isinstance(source, fx.Node) or source.op != "placeholder":
                continue
            value = _tensor(source)
            if value is None or value.dim() != 4:
                continue
            if value.is_contiguous(memory_format=torch.channels_last):
                continue
            name = storages.name(source)
            if name is not None and name not in copies:
                copies[name] = f"{name}.channels_last"
                storages.sizes[copies[name]] = value.untyped_storage().nbytes()
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
        self.storages = _Storages(self.op_types)
        nodes = list(joint.graph.nodes)
        named = {node: self.storages.name(node) for node in nodes}  # in graph order: producers first
        self.static_storages = {name for node, name in named.items() if _is_primal(node) and name is not None}
        self.forward = [n for n in nodes if n.op == "call_function" and node_info.is_required_fw(n)]
        self.hoisted = _hoisted(self.forward, default_saved)
        self.forward_set = {*self.forward, *self.hoisted}
        self.backward = [n for n in nodes if n.op == "call_function" and n not in self.forward_set]
        self.backward_set = set(self.backward)
        output = next(n for n in nodes if n.op == "output")
        values = [value for value in output.args[0] if isinstance(value, fx.Node)]
        self.forward_outputs = set(output.args[0][:num_fwd_outputs]) - {None}
        primals = [node for node in nodes if _is_primal(node)]
        gradients_of_primals = output.args[0][num_fwd_outputs:]
        with_gradient = [p for p, g in zip(primals, gradients_of_primals, strict=True) if g is not None]
        self.step_constants = _step_constants(self.forward, with_gradient, self.op_types)
        """NOTE [step constants]."""
        self.gradients = set(values) - self.forward_outputs
        self.tangents = [n for n in nodes if n.op == "placeholder" and not _is_primal(n)]
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
        self.forward_fusion = _FusionModel(
            [n for n in nodes if n in self.forward_set],
            self.op_types,
            self.storages.name,
            self._placeholder_storage,
            lambda node: self.activation(node) in kept and self.made_here(node) is not None,
        )
        self.backward_fusion = _FusionModel(
            self.backward,
            self.op_types,
            self.storages.name,
            lambda node: (
                self.saved_reads(node) if node in self.forward_set else self._placeholder_storage(node)
            ),
            lambda node: node in self.gradients,
            _addmm_folds(self.backward),
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
        """Activation storages the kernel computing `node` reads (NOTE [fusion model]): a value
        computed inside the kernel contributes what it reads in turn."""
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
    becomes the node's `backward_points` (NOTE [early release] in simulate.py). `held_bytes` (the
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


def _checkpointable(group: Sequence[fx.Node], op_types: OpTypes) -> bool:
    """A group may be recomputed unless it draws random numbers that recomputing would not replay."""
    return not any(
        _is_random(node, op_types) and _target_name(node) not in REPLAYABLE_RANDOM for node in group
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
    random = any(_is_random(node, reader.op_types) for node in group)
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
        checkpointable=not pinned and _checkpointable(group, reader.op_types),
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
    draws = _random_draws(reader.forward, reader.op_types)
    front_set = {*draws, *reader.step_constants}
    front = [node for node in reader.forward if node in front_set]
    groups = _place_hoisted(_groups(reader.forward, front), reader.hoisted)
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
    )
    return CompiledGraph(
        graph=graph,
        producers={name: reader.storages.producer[name] for name in used if name in reader.storages.producer},
        always_saved=tuple(node for node in draws if _is_random(node, reader.op_types)),
        storage_of={
            node: name for node in reader.forward_set if (name := reader.activation(node)) is not None
        },
        backward=tuple(reader.backward),
        kernel_order=tuple(kernel.node.name for kernel in order),
        kernel_steps={name: index for index, entry in enumerate(backward) for name in entry.kernels},
    )


def _must_save(node: fx.Node, op_types: OpTypes) -> bool:
    """Forward values a partition must save rather than recompute: RNG state that recomputing would not
    replay (NOTE [random operators]), symbolic sizes, and what the partitioner itself pins to the
    forward (collectives, effectful operators, sources of mutations in backward)."""
    from torch._functorch.partitioners import _must_be_in_forward, is_sym_node
    from torch.utils.checkpoint import CheckpointPolicy

    replayable = _target_name(node) in REPLAYABLE_RANDOM
    return (
        (_is_random(node, op_types) and not replayable)
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
            if _is_primal(node):
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
