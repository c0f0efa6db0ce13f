"""Backward operators that read a replayed value get their own copy of its pointwise chain.

NOTE [replay copies]: the partition recomputes a ReLU's output from a saved convolution output and
BatchNorm statistics, and the ReLU's backward computes its mask from that recompute inside its own
kernel: no ReLU output is stored for the backward. Where the plan replays the ReLU's region, the
replay computes the ReLU's output for the next convolution, and the mask's operator read that same FX
node, so inductor stored the replayed output (the float output, not a mask) and kept it until the
ReLU's backward, through the next block's whole backward. The CNN with BatchNorm and `nn.Dropout2d` of
planner/testing/compiled_models.py, at its lowest plan (9,404,928 B predicted), measured 11,497,984 B
at its first compilation: one block's 2 MiB output over. The planner's model, like the backward without
a replay, computes the mask from the saved values. So each pointwise backward operator that reads a
replayed value made by pointwise operators (and views) from what the backward holds gets its own copy
of that chain, placed just before it: inductor computes the copy inside the reader's kernel, and the
replay's value dies with its last replay reader, as the model has it. That plan then measured
9,401,344 B. A reader that is not pointwise (a convolution's backward) keeps the replayed value: a copy
would be stored all the same, and the model keeps that value for it (it is in the reader's saves).
"""

from __future__ import annotations

from collections.abc import Set

import torch
from torch import fx

__all__ = ["copy_replays_for_readers"]


def copy_replays_for_readers(backward: fx.GraphModule, replayed: Set[str]) -> tuple[fx.GraphModule, set[str]]:
    """`backward` with each reader of a replayed pointwise value (one of `replayed`, forward operators
    the backward computes) that is not itself replayed reading a copy of that value's chain (NOTE
    [replay copies]); and the names of the copies, which are replayed too."""
    graph = backward.graph
    copies: dict[fx.Node, fx.Node] = {}
    made: set[str] = set()

    def copyable(node: fx.Node) -> bool:
        return node.name in replayed and _pointwise_or_view(node)

    def copy_of(node: fx.Node, before: fx.Node) -> fx.Node:
        """The copy of `node`'s chain, made before `before` (its first reader: the copies are shared)."""
        if node not in copies:
            sources = {source: copy_of(source, before) for source in node.all_input_nodes if copyable(source)}
            with graph.inserting_before(before):
                copied = graph.node_copy(node, lambda source: sources.get(source, source))
            copies[node] = copied
            made.add(copied.name)
        return copies[node]

    for reader in list(graph.nodes):
        if reader.name in replayed or reader.name in made or not _pointwise(reader):
            continue
        for source in reader.all_input_nodes:
            if copyable(source) and _read_by_replay(source, replayed):
                reader.replace_input_with(source, copy_of(source, reader))
    graph.lint()
    return fx.GraphModule(backward, graph), made


def _read_by_replay(node: fx.Node, replayed: Set[str]) -> bool:
    """Whether the replay itself reads `node` (so it is computed apart from its backward readers)."""
    return any(user.name in replayed for user in node.users)


def _pointwise_or_view(node: fx.Node) -> bool:
    return _pointwise(node) or (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _pointwise(node: fx.Node) -> bool:
    """Whether inductor computes `node` inside the kernel that reads it (a view is only a view: what
    reads it decides whether a copy is stored)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
