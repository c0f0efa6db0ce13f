"""Checks that a graph from outside (a posted document, a file) is one the simulator and solvers can use.

`build_activation_graph` only makes well-formed graphs, but the REST service solves graphs that anyone
can post, and a malformed one must be answered with what is wrong rather than a KeyError from deep in
the simulator. The rules follow ir.py:

- nodes are listed in execution order: a node's `inputs` that name nodes name earlier ones (an input
  naming a later node, or itself, is a cycle); `inputs` may also name graph inputs and constants, which
  are not nodes;
- every storage a node creates, reads or saves is listed in `storage_bytes`, is created by exactly one
  node, and is read only after it was created (saved at or after); the storages a node remakes in a
  selective replay (`replayed_when_kept`) are among those it creates;
- sizes are non-negative integers and times non-negative finite numbers;
- the graph has at least one node, and no more than the caller's limit, and some memory to plan
  (a graph whose every size is 0 has no peak to lower).

Problems are collected (up to `MAX_PROBLEMS`) so that one answer lists them all. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import networkx as nx

from planner.errors import GraphProblem, InvalidGraph
from planner.ir import ActivationGraph, Node, StaticBytes

__all__ = ["MAX_PROBLEMS", "validate_graph"]

MAX_PROBLEMS = 20
"""Enough to show a pattern; a graph with more problems is broken wholesale and the first ones say how."""


def _number_problems(record: Node | StaticBytes, location: tuple[str | int, ...]) -> Iterator[GraphProblem]:
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or value < 0:
            yield GraphProblem((*location, field.name), f"must be a finite number >= 0, got {value!r}")


def _storage_problems(graph: ActivationGraph) -> Iterator[GraphProblem]:
    for name, size_bytes in graph.storage_bytes.items():
        if size_bytes < 0:
            yield GraphProblem(("storage_bytes", name), f"storage {name!r} has negative size {size_bytes}")
    creator: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.creates:
            if name in creator:
                yield GraphProblem(
                    ("nodes", index, "creates"),
                    f"node {node.name!r} creates storage {name!r}, which node "
                    f"{graph.nodes[creator[name]].name!r} already created; a storage has one creator",
                )
            else:
                creator[name] = index
    for index, node in enumerate(graph.nodes):
        for field, names, latest in (("reads", node.reads, index - 1), ("saves", node.saves, index)):
            for name in names:
                yield from _reference_problems(graph, index, field, name, creator.get(name), latest)
        for name in node.creates:
            if name not in graph.storage_bytes:
                yield GraphProblem(
                    ("nodes", index, "creates"),
                    f"node {node.name!r} creates storage {name!r}, which storage_bytes does not list",
                )
        for name in node.replayed_when_kept:
            if name not in node.creates:
                yield GraphProblem(
                    ("nodes", index, "replayed_when_kept"),
                    f"node {node.name!r} lists storage {name!r} as replayed when kept but does not create it",
                )


def _reference_problems(
    graph: ActivationGraph, index: int, field: str, name: str, created_at: int | None, latest: int
) -> Iterator[GraphProblem]:
    """Problems with node `index` using storage `name`, which must have been created by node `latest`."""
    node = graph.nodes[index]
    if name not in graph.storage_bytes:
        yield GraphProblem(
            ("nodes", index, field),
            f"node {node.name!r} {field} storage {name!r}, which storage_bytes does not list (dangling)",
        )
    elif created_at is None:
        yield GraphProblem(
            ("nodes", index, field),
            f"node {node.name!r} {field} storage {name!r}, which no node creates (dangling)",
        )
    elif created_at > latest:
        yield GraphProblem(
            ("nodes", index, field),
            f"node {node.name!r} {field} storage {name!r} before node {graph.nodes[created_at].name!r} "
            "creates it: a cycle, or nodes not in execution order",
        )


def _order_problems(graph: ActivationGraph) -> Iterator[GraphProblem]:
    position: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        if node.name in position:
            yield GraphProblem(
                ("nodes", index, "name"), f"node name {node.name!r} repeats node {position[node.name]}"
            )
        else:
            position[node.name] = index
    out_of_order = {
        index: later
        for index, node in enumerate(graph.nodes)
        if (later := [name for name in node.inputs if position.get(name, -1) >= index])
    }
    if not out_of_order:
        return  # every input that names a node names an earlier one: no cycle is possible
    try:
        cycle = nx.find_cycle(graph.to_networkx())
    except nx.NetworkXNoCycle:
        cycle = []
    if cycle:
        path = " -> ".join([*(source for source, _ in cycle), cycle[0][0]])
        yield GraphProblem(("nodes", position[cycle[0][1]], "inputs"), f"the inputs form a cycle: {path}")
        return
    for index, later in out_of_order.items():
        yield GraphProblem(
            ("nodes", index, "inputs"),
            f"node {graph.nodes[index].name!r} takes inputs {later} from nodes listed after it; "
            "list nodes in execution order",
        )


def _problems(graph: ActivationGraph, max_nodes: int | None) -> Iterator[GraphProblem]:
    if not graph.nodes:
        yield GraphProblem(("nodes",), "the graph has no nodes")
    if max_nodes is not None and len(graph.nodes) > max_nodes:
        yield GraphProblem(
            ("nodes",), f"the graph has {len(graph.nodes)} nodes, more than the limit of {max_nodes}"
        )
        return
    yield from _number_problems(graph.static, ("static",))
    for index, node in enumerate(graph.nodes):
        yield from _number_problems(node, ("nodes", index))
    yield from _order_problems(graph)
    yield from _storage_problems(graph)
    if graph.nodes and _total_bytes(graph) == 0:
        yield GraphProblem(("storage_bytes",), "every size in the graph is 0: there is no memory to plan")


def _total_bytes(graph: ActivationGraph) -> int:
    static = dataclasses.astuple(graph.static)
    per_node = [node.forward_workspace_bytes + node.backward_workspace_bytes for node in graph.nodes]
    return sum(static) + sum(graph.storage_bytes.values()) + sum(per_node)


def validate_graph(graph: ActivationGraph, *, max_nodes: int | None = None) -> None:
    """Raise `InvalidGraph` listing what is wrong with `graph`; return None when the solvers can use it."""
    problems: list[GraphProblem] = []
    for problem in _problems(graph, max_nodes):
        problems.append(problem)
        if len(problems) >= MAX_PROBLEMS:
            break
    if problems:
        raise InvalidGraph(problems)
