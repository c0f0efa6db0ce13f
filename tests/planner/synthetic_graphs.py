"""Hand-built and random activation graphs for solver and simulator tests, and the brute-force oracle
over their schedules (no torch)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator

from planner.ir import GLUE_OP, ActivationGraph, Node, Region, RegionPolicy, Schedule, StaticBytes
from planner.simulation.step import CheckpointRule

MIB = 2**20


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
    `per_operator_ms` (see planner/selective_cost.py)."""
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
