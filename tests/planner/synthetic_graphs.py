"""Hand-built and random activation graphs for solver and simulator tests (no torch)."""

from __future__ import annotations

import dataclasses
import random

from planner.ir import ActivationGraph, Node, StaticBytes

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
    """A random chain whose nodes allocate (some beyond their outputs), so selective keeps matter."""
    graph = random_chain(rng, length)
    nodes = []
    for node in graph.nodes:
        if not node.checkpointable:
            nodes.append(node)
            continue
        created = sum(graph.storage_bytes[name] for name in node.creates)
        extra = rng.choice([0, 0, MIB // 2])
        nodes.append(
            dataclasses.replace(node, allocated_bytes=created + extra, forward_workspace_bytes=extra)
        )
    return dataclasses.replace(graph, nodes=tuple(nodes))


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
