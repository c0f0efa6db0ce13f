"""How inductor turns the values of a joint graph into buffers, as the planner predicts it before any
kernel exists: which values are stored (NOTE [fusion model]) and what each kernel reads, with the
storage names the compiled graph (joint_graph.py) counts bytes in.

NOTE [fusion model]: a forward or backward value is materialised (allocated as a buffer) when it is a
graph output (a saved value, the model's output, a gradient), when the operator that makes it is not
fusible (matmuls, convolutions: extern kernels), or when an operator that is not fusible reads it.
Every other value is computed inside the kernel that consumes it. This is the partitioner's own notion
(`is_materialized` in torch/_functorch/partitioners.py, over `get_default_op_list()`), except that an
operator drawing random numbers that inductor does not generate itself (dropout, `rand`, `bernoulli`
under `torch._inductor.config.fallback_random`) runs as aten's own kernel, which fuses nothing: its
input is stored (a ViT's ReLU before dropout was predicted inlined, 1 MiB a layer low); inductor's
scheduler may still fuse or reuse more, which tests measure against the compiled step's real peak.

NOTE [addmm]: after partitioning, inductor's post-grad pass rewrites `add(mm(a, b), c)` into one
`addmm(c, a, b)` where the mm has no other user (`addmm` in torch/_inductor/fx_passes/post_grad.py).
In a backward that sums two gradients of one tensor (an input embedding tied to the language-model
head: the head's weight gradient `mm(grad_logits.T, h)` plus the embedding's scatter), the mm then
runs where the add runs, at the very end, and the logits' gradient it reads stays allocated until
then. The backward's fusion model folds such an mm into its add (`addmm_folds`): the add is a kernel
of its own that reads the mm's inputs, and the mm makes no buffer. A three-layer language model with
tied weights measured 2 MiB (the logits' gradient) above its prediction without this; GPT-2 ties its
weights the same way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import fx
from torch._functorch.partitioners import OpTypes

from planner.profiler.counting import counted_bytes

__all__ = [
    "INDUCTOR_RANDOM",
    "REPLAYABLE_RANDOM",
    "SEEDS_NODE",
    "FusionModel",
    "Storages",
    "addmm_folds",
    "is_primal",
    "node_tensor",
    "target_name",
]


def is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" not in str(node.target)


def node_tensor(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def target_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0] if isinstance(target, torch._ops.OpOverload) else name


class Storages:
    """Storage names of tensor values (views share their base's), and which are materialised."""

    def __init__(self, op_types: OpTypes) -> None:
        self.op_types = op_types
        self.name_of_key: dict[int, str] = {}
        self.sizes: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.producer: dict[str, fx.Node] = {}

    def name(self, node: fx.Node) -> str | None:
        """The storage of `node`'s value, named after the first node that made it (None: no tensor)."""
        tensor = node_tensor(node)
        if tensor is None or tensor.untyped_storage().nbytes() == 0:
            return None
        key = _storage_key(tensor)
        if key not in self.name_of_key:
            self.name_of_key[key] = node.name
            self.sizes[node.name] = counted_bytes(tensor.untyped_storage().nbytes())
            self.dtypes[node.name] = tensor.dtype
            self.producer[node.name] = node
        return self.name_of_key[key]


SEEDS_NODE = "inductor_seeds"
REPLAYABLE_RANDOM = frozenset({"inductor_random", "inductor_lookup_seed"})
"""Random operators that inductor computes from a saved seed: recomputing them replays the same numbers."""
INDUCTOR_RANDOM = REPLAYABLE_RANDOM | {SEEDS_NODE}
"""inductor's own random operators; any other that draws (`native_dropout`, `rand`, `bernoulli` under
`fallback_random`) runs as aten's kernel."""


REALIZE_READS = 4
"""inductor's `realize_reads_threshold`: a value read by several kernels is stored once it reads more."""


REALIZE_ACCUMULATED_READS = 8
"""inductor's `realize_acc_reads_threshold`: a value whose inlined computation reads more is stored."""


HEAVY_OPS = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})
"""On the CPU inductor stores a value used by several kernels whose computation includes one of these."""


class FusionModel:
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
            ops = {target_name(node)}
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
        if node_tensor(node) is None or node in self.folded:
            return False
        if node in self.addmm:
            return True
        # one output of a multi-output operator (var_mean) is stored as that operator would be
        operator_node = node.args[0] if node.target is operator.getitem else node
        assert isinstance(operator_node, fx.Node)
        if is_output or not self._fusible(operator_node) or _is_reduction(operator_node, node):
            return True
        users = _users_through_views(node, self.op_types, part)
        if any(user.op == "output" or user in self.addmm or not self._fusible(user) for user in users):
            return True
        if len(set(node.users)) > 1 and (ops & HEAVY_OPS or len(reads) > REALIZE_READS):
            return True
        return len(reads) > REALIZE_ACCUMULATED_READS

    def _fusible(self, node: fx.Node) -> bool:
        if target_name(node) in REPLAYABLE_RANDOM:
            return True  # generated inside the kernel that reads it
        return self.op_types.is_fusible(node) and not _fallback_random(node)


def _fallback_random(node: fx.Node) -> bool:
    """Whether `node` draws random numbers in an aten kernel of its own (NOTE [fusion model])."""
    target = node.target
    seeded = isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
    return seeded and target_name(node) not in INDUCTOR_RANDOM


def addmm_folds(nodes: Sequence[fx.Node]) -> dict[fx.Node, fx.Node]:
    """NOTE [addmm]: each `add(mm(a, b), c)` (either order) of `nodes` that inductor's post-grad pass
    turns into `addmm(c, a, b)` -> its mm: the mm's only user is the add, and `c` is a tensor of the
    mm's dtype that expands to its shape (`is_valid_addmm_fusion` in torch/_inductor/fx_passes/
    post_grad.py; on a GPU, an add whose users are all pointwise stays unfused, and is left here)."""
    part = set(nodes)
    folds: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.target is not torch.ops.aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        value = node_tensor(node)
        if value is None or (value.device.type != "cpu" and all(_pointwise(user) for user in node.users)):
            continue
        for mm, other in (node.args, node.args[::-1]):
            if not (isinstance(mm, fx.Node) and mm in part and mm.target is torch.ops.aten.mm.default):
                continue
            if len(mm.users) != 1 or not isinstance(other, fx.Node):
                continue
            product, addend = node_tensor(mm), node_tensor(other)
            operands = [node_tensor(source) for source in mm.all_input_nodes]
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
    output = node_tensor(value)
    inputs = [t for source in operator_node.all_input_nodes if (t := node_tensor(source)) is not None]
    return output is not None and any(t.numel() > output.numel() for t in inputs)
