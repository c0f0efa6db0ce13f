"""Synthetic activation graphs, built from the ir records alone (no torch, no profiling), and the
brute-force oracle over their schedules.

The service's load benchmark, the container smoke test and the API tests need graphs of a chosen size
that look like what `build_activation_graph` produces for a real model, on machines that have no torch.
`residual_graph` builds a stack of residual blocks, the shape of a transformer or ResNet trunk: inside
a block a chain of operators runs beside the block's input (the residual), and the block ends with an
addition of the two. Block boundaries are therefore the graph's cuts, as in a real transformer, and the
solvers see the same kind of plan space. `dag_graph` adds the long reads that make real models DAGs:
an encoder's output read by every decoder block (cross-attention), or a U-Net's skips read across the
U. Sizes and times are drawn from a seeded generator, so a graph is reproducible from its arguments.

The solver and simulator tests need smaller graphs whose every schedule can be tried: hand-built chains
(`chain_graph`, on `static_bytes`), random chains and DAGs (`random_chain`, `keepable_chain`,
`random_dag`), the same with selective prices, keeps saved before they are made or a split call
(`with_selective_price`, `saved_before_made`, `with_split_call`), and `all_schedules`, every schedule of
such a graph, the brute-force oracle the exact solvers must match. Both kinds are built the same way
from the same records, so they live in one module.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator

from planner.ir import GLUE_OP, ActivationGraph, Node, Region, RegionPolicy, Schedule, StaticBytes
from planner.simulation.step import CheckpointRule

__all__ = [
    "DAG_KINDS",
    "MIB",
    "all_schedules",
    "chain_graph",
    "dag_graph",
    "keepable_chain",
    "random_chain",
    "random_dag",
    "residual_graph",
    "saved_before_made",
    "static_bytes",
    "with_selective_price",
    "with_split_call",
]

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


def static_bytes(parameter_bytes: int = 4 * MIB) -> StaticBytes:
    return StaticBytes(
        parameter_bytes=parameter_bytes,
        buffer_bytes=0,
        input_bytes=MIB,
        gradient_bytes=parameter_bytes,
        optimizer_state_bytes=2 * parameter_bytes,
        optimizer_step_workspace_bytes=MIB,
    )


def chain_graph(
    sizes_mib: list[int], *, forward_ms: list[float] | None = None, seed_saves: bool = True
) -> ActivationGraph:
    """A chain: node i reads node i-1's output and saves it (like Linear), then a loss node."""
    nodes = []
    storage_bytes = {}
    times = forward_ms or [1.0] * len(sizes_mib)
    for index, size in enumerate(sizes_mib):
        storage_bytes[f"s{index}"] = size * MIB
        previous = (f"s{index - 1}",) if index > 0 else ()
        nodes.append(
            Node(
                name=f"n{index}",
                op="linear",
                module_path=f"layers.{index}",
                inputs=(f"n{index - 1}",) if index > 0 else (),
                creates=(f"s{index}",),
                reads=previous,
                saves=previous if seed_saves else (),
                saves_anything=True,
                forward_ms=times[index],
                backward_ms=2 * times[index],
                forward_workspace_bytes=0,
                backward_workspace_bytes=sizes_mib[index] * MIB,
                parameter_gradient_bytes=MIB // 4,
            )
        )
    last = f"s{len(sizes_mib) - 1}"
    nodes.append(
        Node(
            name="loss",
            op="loss_fn",
            module_path="",
            inputs=(nodes[-1].name,),
            creates=(),
            reads=(last,),
            saves=(last,),
            saves_anything=True,
            forward_ms=0.1,
            backward_ms=0.1,
            forward_workspace_bytes=0,
            backward_workspace_bytes=0,
            checkpointable=False,
        )
    )
    return ActivationGraph(
        nodes=tuple(nodes),
        storage_bytes=storage_bytes,
        static=static_bytes(),
        capture="synthetic",
        optimizer="adam",
    )


def random_chain(rng: random.Random, length: int) -> ActivationGraph:
    """A random chain with random sizes and times, some nodes saving nothing (like views)."""
    sizes = [rng.randint(1, 8) for _ in range(length)]
    times = [rng.uniform(0.1, 5.0) for _ in range(length)]
    return chain_graph(sizes, forward_ms=times)


def keepable_chain(rng: random.Random, length: int) -> ActivationGraph:
    """A random chain whose nodes allocate (some beyond their outputs), so selective keeps matter; some
    also make and save a cast a selective policy replays rather than caches (`replayed_when_kept`)."""
    graph = random_chain(rng, length)
    storage_bytes = dict(graph.storage_bytes)
    nodes = []
    for node in graph.nodes:
        if not node.checkpointable:
            nodes.append(node)
            continue
        created = sum(graph.storage_bytes[name] for name in node.creates)
        extra = rng.choice([0, 0, MIB // 2])
        node = dataclasses.replace(node, keep_cache_bytes=created + extra, forward_workspace_bytes=extra)
        if rng.random() < 0.4:
            cast = f"{node.name}.cast"
            storage_bytes[cast] = rng.choice([MIB // 4, MIB])
            node = dataclasses.replace(
                node,
                creates=(*node.creates, cast),
                saves=(*node.saves, cast),
                replayed_when_kept=(cast,),
                saves_anything=True,
            )
        nodes.append(node)
    return dataclasses.replace(graph, nodes=tuple(nodes), storage_bytes=storage_bytes)


def with_selective_price(
    graph: ActivationGraph, operator_counts: list[int], per_operator_ms: float
) -> ActivationGraph:
    """`graph` whose nodes dispatch `operator_counts` operators, each costing a selective policy
    `per_operator_ms` (see planner/profiler/selective_cost.py)."""
    nodes = tuple(
        dataclasses.replace(node, operator_count=count)
        for node, count in zip(graph.nodes, operator_counts, strict=True)
    )
    return dataclasses.replace(graph, nodes=nodes, selective_op_overhead_ms=per_operator_ms)


def random_dag(rng: random.Random, length: int) -> ActivationGraph:
    """A random DAG: each node reads the previous output and, often, a storage made further back (a
    skip connection, a feature list, an encoder output); saves some of what it reads or its own output;
    every node runs in its own block, so every position is a candidate boundary."""
    nodes = []
    storage_bytes: dict[str, int] = {}
    for index in range(length):
        name = f"s{index}"
        storage_bytes[name] = rng.randint(1, 8) * MIB
        reads = [f"s{index - 1}"] if index else []
        if index > 1 and rng.random() < 0.6:
            reads.append(f"s{rng.randrange(index - 1)}")
        saves = [read for read in reads if rng.random() < 0.5]
        if rng.random() < 0.3:
            saves.append(name)
        forward_ms = rng.uniform(0.1, 5.0)
        nodes.append(
            Node(
                name=f"n{index}",
                op=rng.choice(["linear", "cat", "add", "relu"]),
                module_path=f"blocks.{index}.op",
                inputs=tuple(f"n{int(read[1:])}" for read in reads),
                creates=(name,),
                reads=tuple(reads),
                saves=tuple(saves),
                saves_anything=bool(saves) or rng.random() < 0.3,
                forward_ms=forward_ms,
                backward_ms=2 * forward_ms,
                forward_workspace_bytes=rng.choice([0, MIB]),
                backward_workspace_bytes=rng.randint(0, 4) * MIB,
                parameter_gradient_bytes=rng.choice([0, MIB // 4]),
            )
        )
    outputs = [f"s{length - 1}"] + ([f"s{rng.randrange(length - 1)}"] if rng.random() < 0.3 else [])
    nodes.append(
        Node(
            name="loss",
            op="loss_fn",
            module_path="",
            inputs=tuple(f"n{int(read[1:])}" for read in outputs),
            creates=(),
            reads=tuple(outputs),
            saves=(outputs[0],),
            saves_anything=True,
            forward_ms=0.1,
            backward_ms=0.1,
            forward_workspace_bytes=0,
            backward_workspace_bytes=0,
            checkpointable=False,
        )
    )
    return ActivationGraph(
        nodes=tuple(nodes),
        storage_bytes=storage_bytes,
        static=static_bytes(),
        capture="synthetic",
        optimizer="adam",
    )


def saved_before_made(graph: ActivationGraph, rng: random.Random) -> ActivationGraph:
    """`graph` with some nodes also saving what one of the next three nodes makes, as inductor's fused
    backward kernels do (NOTE [saved before made] in planner/solvers/chain.py)."""
    nodes = list(graph.nodes)
    for index in range(len(nodes) - 2):
        if rng.random() < 0.4:
            later = rng.randint(index + 1, min(index + 3, len(nodes) - 2))
            saves = (*nodes[index].saves, *nodes[later].creates)
            nodes[index] = dataclasses.replace(nodes[index], saves=saves, saves_anything=True)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def with_split_call(graph: ActivationGraph, start: int, stop: int, caller: str = "mixer") -> ActivationGraph:
    """`graph` with nodes [start, stop) made the parts of one split call (NOTE [split calls] in
    simulation/step.py): glue at even offsets, child calls between them."""
    nodes = list(graph.nodes)
    for offset, index in enumerate(range(start, stop)):
        glue = offset % 2 == 0
        nodes[index] = dataclasses.replace(
            nodes[index],
            op=GLUE_OP if glue else "child",
            module_path=caller if glue else f"{caller}.child{offset // 2}",
            part_of=caller,
        )
    return dataclasses.replace(graph, nodes=tuple(nodes))


def all_schedules(graph: ActivationGraph) -> Iterator[Schedule]:
    """Every partition of a chain into regions, each stored or checkpointed (loss never checkpointed;
    a split call checkpointed whole or one child call at a time, NOTE [split calls])."""
    count = len(graph.nodes)
    rule = CheckpointRule.of(graph)
    for cut_mask in itertools.product((False, True), repeat=count - 1):
        bounds = [0, *[i + 1 for i, cut in enumerate(cut_mask) if cut], count]
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        for policies in itertools.product(tuple(RegionPolicy), repeat=len(spans)):
            regions = tuple(Region(a, b, p) for (a, b), p in zip(spans, policies, strict=True))
            if any(
                r.policy is RegionPolicy.CHECKPOINT and not rule.allows(graph, r.start, r.stop)
                for r in regions
            ):
                continue
            yield Schedule(regions=regions, solver="brute-force")
