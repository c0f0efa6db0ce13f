"""Which forward operators of the compiled step form one node of its graph, and which nodes a plan
may checkpoint: autograd's operator groups, with random draws (NOTE [random operators]) and values
that depend on no gradient (NOTE [step constants]) pulled into a first node that is never recomputed.

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

from collections.abc import Iterable, Sequence

import torch
from torch import fx
from torch._functorch.partitioners import OpTypes

from planner.compiled.fusion import REPLAYABLE_RANDOM, SEEDS_NODE, node_tensor, target_name

__all__ = [
    "SEEDS_NODE",
    "REPLAYABLE_RANDOM",
    "checkpointable_group",
    "hoisted_operators",
    "is_random",
    "operator_groups",
    "place_hoisted",
    "random_draws",
    "step_constants",
]


FREE_CONSTANT_OPS = frozenset(
    {"full", "scalar_tensor", "iota", "clone", "convert_element_type", "_to_copy", "copy"}
    | {"constant_pad_nd", "cat", "empty", "zeros", "ones", "new_empty", "new_zeros", "new_ones"}
)
"""Operators that fill or copy: a step constant computed by these alone costs nothing to inline (NOTE
[step constants])."""


def is_random(node: fx.Node, op_types: OpTypes) -> bool:
    """Whether `node` draws random numbers: aten's `nondeterministic_seeded` operators (dropout,
    bernoulli, rand), the partitioner's random list, and inductor's seeds and random prims."""
    target = node.target
    seeded = isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
    return seeded or op_types.is_random(node) or target_name(node) in (SEEDS_NODE, *REPLAYABLE_RANDOM)


def random_draws(forward: Sequence[fx.Node], op_types: OpTypes) -> list[fx.Node]:
    """Forward nodes that draw random numbers from nothing the step computes (inductor's seeds, the
    `bernoulli_` a Dropout2d fills a fresh tensor with), with the nodes they draw into, in order: NOTE
    [random operators]."""
    found: set[fx.Node] = set()
    for node in forward:
        if not is_random(node, op_types) or target_name(node) in REPLAYABLE_RANDOM:
            continue
        draw, pending = {node}, list(node.all_input_nodes)
        while pending:
            source = pending.pop()
            if source.op == "placeholder" or source in draw:
                continue
            draw.add(source)
            pending += source.all_input_nodes
        if not any(source.op == "placeholder" for member in draw for source in member.all_input_nodes):
            found |= draw
    return [node for node in forward if node in found]


def step_constants(
    forward: Sequence[fx.Node], with_gradient: Iterable[fx.Node], op_types: OpTypes
) -> list[fx.Node]:
    """Forward nodes that compute a step constant by arithmetic for a non-constant operator to read,
    with the constants it is computed from, in order (NOTE [step constants]). `with_gradient`: the
    primals the joint graph returns a gradient for."""
    varying = set(with_gradient)
    constants: list[fx.Node] = []
    for node in forward:
        if is_random(node, op_types) or any(source in varying for source in node.all_input_nodes):
            varying.add(node)
        else:
            constants.append(node)
    constant_set = set(constants)
    pinned: set[fx.Node] = set()
    for node in constants:
        tensor = node_tensor(node)
        if tensor is None or tensor.numel() <= 1 or all(user in constant_set for user in node.users):
            continue
        cone = _constant_cone(node, constant_set)
        if any(not op_types.is_view(n) and target_name(n) not in FREE_CONSTANT_OPS for n in cone):
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


def operator_groups(forward: Sequence[fx.Node], front: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """Forward nodes grouped by the eager operator they decompose (autograd's `seq_nr`), in order.

    Nodes without a sequence number (the random operators inductor substitutes for dropout, views it
    adds) join the next group that has one. `front` (the random draws, NOTE [random operators]; the
    step constants, NOTE [step constants]) is a group of its own, first.
    """
    front_set = set(front)
    groups: list[list[fx.Node]] = []
    pending: list[fx.Node] = []
    current_seq: object = None
    for node in forward:
        if node in front_set:
            continue
        seq = node.meta.get("seq_nr")
        if seq is None:
            pending.append(node)
            continue
        if groups and seq == current_seq:
            groups[-1] += [*pending, node]
        else:
            groups.append([*pending, node])
        pending = []
        current_seq = seq
    if pending:
        if groups:
            groups[-1] += pending
        else:
            groups.append(pending)
    return [list(front), *groups] if front else groups


def hoisted_operators(forward: Sequence[fx.Node], default_saved: Iterable[fx.Node]) -> list[fx.Node]:
    """Backward operators that do not depend on the gradient (a transpose of a saved value, a LayerNorm
    backward's scale), which the partition computes in the forward and saves, with the gradient-free
    operators they need, in graph order (NOTE [hoisted operators] in optimize.py)."""
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


def place_hoisted(groups: list[list[fx.Node]], hoisted: Sequence[fx.Node]) -> list[list[fx.Node]]:
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


def checkpointable_group(group: Sequence[fx.Node], op_types: OpTypes) -> bool:
    """A group may be recomputed unless it draws random numbers that recomputing would not replay."""
    return not any(is_random(node, op_types) and target_name(node) not in REPLAYABLE_RANDOM for node in group)
