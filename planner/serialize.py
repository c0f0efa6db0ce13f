"""The versioned JSON form of graphs and schedules (`planner.graph/v1`, `planner.plan/v1`).

Plain dicts of plain values: the REST service and the library share this one serializer, and loading
never executes or unpickles anything. Unknown schema versions are rejected with the version found.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planner.ir import (
    GRAPH_SCHEMA,
    ActivationGraph,
    CostModel,
    MemoryCounting,
    Node,
    Region,
    RegionPolicy,
    Schedule,
    StaticBytes,
    TrainingStep,
)

__all__ = ["graph_to_dict", "graph_from_dict", "schedule_to_dict", "schedule_from_dict"]


def _check_schema(data: dict[str, Any], expected: str) -> None:
    found = data.get("schema")
    if found != expected:
        raise ValueError(f"expected a {expected!r} document, got schema={found!r}")


def graph_to_dict(graph: ActivationGraph) -> dict[str, Any]:
    return {
        "schema": GRAPH_SCHEMA,
        "capture": graph.capture,
        "optimizer": graph.optimizer,
        "timing": graph.timing,
        "selective_op_overhead_ms": graph.selective_op_overhead_ms,
        "checkpoint_call_ms": graph.checkpoint_call_ms,
        "checkpoint_op_ms": graph.checkpoint_op_ms,
        "static": dataclasses.asdict(graph.static),
        "step": dataclasses.asdict(graph.step),
        "memory_counting": graph.memory_counting.value,
        "storage_bytes": dict(graph.storage_bytes),
        "nodes": [
            {
                **_fields_of(node),
                **{key: list(getattr(node, key)) for key in _TUPLE_FIELDS},
                "backward_points": [[workspace, list(freed)] for workspace, freed in node.backward_points],
            }
            for node in graph.nodes
        ],
    }


_TUPLE_FIELDS = ("inputs", "creates", "reads", "saves", "replayed_when_kept")
_OPTIONAL = frozenset({"replayed_when_kept"})
"""Node fields added since `planner.graph/v1` was first written: absent from older documents."""


def _fields_of(node: Node) -> dict[str, Any]:
    """A node's fields, shallow: `dataclasses.asdict` deep-copies every value and is 30x slower, which
    the service pays on every request for a large graph."""
    return {field.name: getattr(node, field.name) for field in dataclasses.fields(node)}


def graph_from_dict(data: dict[str, Any]) -> ActivationGraph:
    _check_schema(data, GRAPH_SCHEMA)
    nodes = tuple(
        Node(
            **{
                **_renamed(raw),
                **{key: tuple(raw[key]) for key in _TUPLE_FIELDS if key in raw or key not in _OPTIONAL},
                "backward_points": tuple(
                    (int(workspace), tuple(freed)) for workspace, freed in raw.get("backward_points", ())
                ),
            }
        )
        for raw in data["nodes"]
    )
    return ActivationGraph(
        nodes=nodes,
        storage_bytes={str(name): int(size) for name, size in data["storage_bytes"].items()},
        static=_static_from_dict(data["static"]),
        capture=str(data["capture"]),
        optimizer=str(data["optimizer"]),
        timing=str(data.get("timing", CostModel.MEASURED.value)),
        selective_op_overhead_ms=float(data.get("selective_op_overhead_ms", 0.0)),
        checkpoint_call_ms=float(data.get("checkpoint_call_ms", 0.0)),
        checkpoint_op_ms=float(data.get("checkpoint_op_ms", 0.0)),
        step=TrainingStep(**data.get("step", {})),
        memory_counting=_counting_from(data.get("memory_counting", MemoryCounting.EXACT.value)),
    )


def _counting_from(raw: Any) -> MemoryCounting:
    """A graph's `memory_counting`; documents written before it existed counted exact bytes."""
    try:
        return MemoryCounting(raw)
    except ValueError as error:
        choices = [member.value for member in MemoryCounting]
        raise ValueError(f"memory_counting={raw!r} is not known; use one of {choices}") from error


_RENAMED_NODE_FIELDS = {"allocated_bytes": "keep_cache_bytes"}
"""Node fields renamed since `planner.graph/v1` was first written: old documents still load."""


def _renamed(raw: dict[str, Any]) -> dict[str, Any]:
    return {_RENAMED_NODE_FIELDS.get(key, key): value for key, value in raw.items()}


def _static_from_dict(raw: dict[str, Any]) -> StaticBytes:
    """Graphs written before `accumulated_gradient_bytes` existed had no input gradients apart."""
    return StaticBytes(**{"accumulated_gradient_bytes": raw["gradient_bytes"], **raw})


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    return {
        "solver": schedule.solver,
        "gap": schedule.gap,
        "regions": [
            {
                "start": region.start,
                "stop": region.stop,
                "policy": region.policy.value,
                "keep": list(region.keep),
            }
            for region in schedule.regions
        ],
    }


def schedule_from_dict(data: dict[str, Any]) -> Schedule:
    return Schedule(
        regions=tuple(
            Region(
                int(raw["start"]),
                int(raw["stop"]),
                RegionPolicy(raw["policy"]),
                tuple(int(index) for index in raw.get("keep", ())),
            )
            for raw in data["regions"]
        ),
        solver=str(data["solver"]),
        gap=float(data.get("gap", 0.0)),
    )
