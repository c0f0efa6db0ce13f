"""Synthetic activation graphs, built from the ir records alone (no torch, no profiling).

The service's load benchmark, the container smoke test and the API tests need graphs of a chosen size
that look like what `build_activation_graph` produces for a real model, on machines that have no torch.
`residual_graph` builds a stack of residual blocks, the shape of a transformer or ResNet trunk: inside
a block a chain of operators runs beside the block's input (the residual), and the block ends with an
addition of the two. Block boundaries are therefore the graph's cuts, as in a real transformer, and the
solvers see the same kind of plan space. `dag_graph` adds the long reads that make real models DAGs:
an encoder's output read by every decoder block (cross-attention), or a U-Net's skips read across the
U. Sizes and times are drawn from a seeded generator, so a graph is reproducible from its arguments.
"""

from __future__ import annotations

import dataclasses
import random

from planner.ir import ActivationGraph, Node, StaticBytes

__all__ = ["DAG_KINDS", "dag_graph", "residual_graph"]

DAG_KINDS = ("encoder-decoder", "u-net")
U_NET_LEVELS = 5
"""Skips of `dag_graph(kind="u-net")`: the outputs of five encoder blocks, each read by its mirror."""

MIB = 2**20
PARAMETER_BYTES_PER_BLOCK = 2 * MIB
"""Weights per block: enough that static memory matters, as it does in real models."""
INPUT_BYTES = 4 * MIB
"""The model input and the residual stream between blocks."""


def _block_nodes(
    rng: random.Random,
    *,
    block: int,
    length: int,
    entry: tuple[str, str] | None,
    storage_bytes: dict[str, int],
) -> list[Node]:
    """One residual block of `length` nodes: `length - 1` chained operators, then `x + branch`.

    `entry` is (node, storage) of the previous block's output; None for the first block, whose input
    is the model's input (static memory, not an activation).
    """
    nodes: list[Node] = []
    previous = entry
    for position in range(length - 1):
        name = f"b{block}_op{position}"
        storage = f"{name}_out"
        storage_bytes[storage] = rng.randint(1, 8) * MIB
        is_matmul = position % 2 == 0
        forward_ms = rng.uniform(0.5, 3.0) if is_matmul else rng.uniform(0.05, 0.3)
        nodes.append(
            Node(
                name=name,
                op="linear" if is_matmul else "gelu",
                module_path=f"blocks.{block}.{'linear' if is_matmul else 'act'}{position}",
                inputs=(previous[0],) if previous else ("input",),
                creates=(storage,),
                reads=(previous[1],) if previous else (),
                saves=(previous[1],) if previous else (),
                saves_anything=True,
                forward_ms=forward_ms,
                backward_ms=2 * forward_ms,
                forward_workspace_bytes=0,
                backward_workspace_bytes=storage_bytes[storage],
                keep_cache_bytes=storage_bytes[storage],
                parameter_gradient_bytes=PARAMETER_BYTES_PER_BLOCK // length if is_matmul else 0,
            )
        )
        previous = (name, storage)
    assert previous is not None, "a block has at least one operator before its add"
    output = f"b{block}_add_out"
    storage_bytes[output] = INPUT_BYTES
    nodes.append(
        Node(
            name=f"b{block}_add",
            op="add",
            module_path=f"blocks.{block}",
            inputs=(previous[0], entry[0] if entry else "input"),
            creates=(output,),
            reads=(previous[1], entry[1]) if entry else (previous[1],),
            saves=(),
            saves_anything=False,
            forward_ms=0.05,
            backward_ms=0.05,
            forward_workspace_bytes=0,
            backward_workspace_bytes=0,
        )
    )
    return nodes


def _block_lengths(body_nodes: int, nodes_per_block: int) -> list[int]:
    """Block sizes that add up to `body_nodes`; a remainder of one joins the last block."""
    lengths = [nodes_per_block] * (body_nodes // nodes_per_block)
    rest = body_nodes % nodes_per_block
    if rest >= 2:
        lengths.append(rest)
    elif rest == 1:
        lengths[-1] += 1
    return lengths


def residual_graph(
    *, node_count: int, nodes_per_block: int = 10, seed: int = 0, distinct_blocks: int | None = None
) -> ActivationGraph:
    """A stack of residual blocks with `node_count` nodes in all (the last one is the loss).

    `nodes_per_block` (at least 2) sets how many nodes lie between two cuts; a final shorter block takes
    what does not divide evenly. Every block draws its own sizes and times, unless `distinct_blocks` is
    given: then block b repeats block b % distinct_blocks, as the layers of a transformer do.
    """
    if distinct_blocks is not None and distinct_blocks < 1:
        raise ValueError(f"distinct_blocks must be at least 1 (or None), got {distinct_blocks}")
    if nodes_per_block < 2:
        raise ValueError(
            f"nodes_per_block must be at least 2 (an operator and the add), got {nodes_per_block}"
        )
    if node_count < nodes_per_block + 1:
        raise ValueError(
            f"node_count={node_count} is too small for one block of {nodes_per_block} nodes and the loss; "
            f"use at least {nodes_per_block + 1}"
        )
    rng = random.Random(seed)
    storage_bytes: dict[str, int] = {}
    nodes: list[Node] = []
    for block, length in enumerate(_block_lengths(node_count - 1, nodes_per_block)):
        entry = (nodes[-1].name, nodes[-1].creates[0]) if nodes else None
        if distinct_blocks is not None:
            rng = random.Random(f"{seed}/{block % distinct_blocks}")
        nodes.extend(_block_nodes(rng, block=block, length=length, entry=entry, storage_bytes=storage_bytes))
    output = nodes[-1].creates[0]
    nodes.append(
        Node(
            name="loss",
            op="loss_fn",
            module_path="",
            inputs=(nodes[-1].name,),
            creates=(),
            reads=(output,),
            saves=(output,),
            saves_anything=True,
            forward_ms=0.1,
            backward_ms=0.1,
            forward_workspace_bytes=0,
            backward_workspace_bytes=0,
            checkpointable=False,
        )
    )
    parameter_bytes = PARAMETER_BYTES_PER_BLOCK * len(_block_lengths(node_count - 1, nodes_per_block))
    static = StaticBytes(
        parameter_bytes=parameter_bytes,
        buffer_bytes=0,
        input_bytes=INPUT_BYTES,
        gradient_bytes=parameter_bytes,
        optimizer_state_bytes=2 * parameter_bytes,
        optimizer_step_workspace_bytes=PARAMETER_BYTES_PER_BLOCK,
    )
    return ActivationGraph(
        nodes=tuple(nodes), storage_bytes=storage_bytes, static=static, capture="synthetic", optimizer="adam"
    )


def _block_starts(graph: ActivationGraph) -> list[int]:
    """Index of each block's first node (after the previous block's add)."""
    starts = [0]
    for index, node in enumerate(graph.nodes[:-2]):
        if node.op == "add":
            starts.append(index + 1)
    return starts


def _long_reads(graph: ActivationGraph, kind: str) -> dict[int, list[str]]:
    """Node index -> storages it also reads and saves (made by a block far before it)."""
    starts = _block_starts(graph)
    ends = [start - 1 for start in starts[1:]]
    half = len(starts) // 2
    reads: dict[int, list[str]] = {}
    if kind == "encoder-decoder":
        encoder_output = graph.nodes[ends[half - 1]].creates[0]
        for start in starts[half:]:
            reads.setdefault(start, []).append(encoder_output)
        return reads
    step = max(1, (half - 1) // U_NET_LEVELS)
    for level in range(1, min(U_NET_LEVELS, half - 1) + 1):
        block = level * step - 1
        mirror = len(starts) - 1 - block
        reads.setdefault(starts[mirror], []).append(graph.nodes[ends[block]].creates[0])
    return reads


def dag_graph(
    *,
    node_count: int,
    kind: str,
    nodes_per_block: int = 10,
    seed: int = 0,
    distinct_blocks: int | None = None,
) -> ActivationGraph:
    """`residual_graph` with long reads: `kind="encoder-decoder"` has the first half's output read (and
    saved, as cross-attention does) by the first operator of every later block; `kind="u-net"` has the
    outputs of five first-half blocks read by the first operator of their mirror blocks."""
    if kind not in DAG_KINDS:
        raise ValueError(f"kind={kind!r} is not known; use one of {list(DAG_KINDS)}")
    graph = residual_graph(
        node_count=node_count, nodes_per_block=nodes_per_block, seed=seed, distinct_blocks=distinct_blocks
    )
    if len(_block_starts(graph)) < 4:
        raise ValueError(f"node_count={node_count} gives fewer than 4 blocks; a DAG needs more")
    nodes = list(graph.nodes)
    for index, extra in _long_reads(graph, kind).items():
        node = nodes[index]
        nodes[index] = dataclasses.replace(
            node, reads=(*node.reads, *extra), saves=(*node.saves, *extra), inputs=(*node.inputs, *extra)
        )
    return dataclasses.replace(graph, nodes=tuple(nodes))
