"""The module level's rewrite: a model planned by its submodules, its checkpointed units wrapped one by one.

Why it exists: a model neither torch.fx nor torch.export can capture, or one planned for FSDP, is planned
by its submodules (capture/model_call.py), and its plan has no graph to fuse: each checkpointed region is
exactly one call of a unit or of a unit's child. `rewrite_units` wraps those in checkpoint on a copy of
the module tree along their paths, sharing every parameter, buffer and untouched submodule with the model, as
`gradient_checkpointing_enable` does by hand, and the root passes for the model's class as emit.py's
planned modules do (NOTE [drop-in]).
"""

from __future__ import annotations

import torch

from planner.ir import GLUE_OP, ActivationGraph, Schedule
from planner.rewrite.emit import planned_class, with_checkpointed_units

__all__ = ["rewrite_units"]


def rewrite_units(model: torch.nn.Module, graph: ActivationGraph, schedule: Schedule) -> torch.nn.Module:
    """A copy of `model`'s module tree in which the checkpointed units run under checkpoint.

    Only the modules on the paths to those units are copied (shallow: parameters, buffers and other
    submodules stay the model's own); the root passes for the model's class (NOTE [drop-in] in
    emit.py).
    """
    paths = [_unit_path(graph, region.start, region.stop) for region in schedule.checkpointed]
    drawing = {
        path
        for path, region in zip(paths, schedule.checkpointed, strict=True)
        if any(node.draws_python for node in graph.nodes[region.start : region.stop])
    }
    planned = with_checkpointed_units(model, paths, drawing=drawing)
    planned.__class__ = planned_class(type(model), runs_graph=False)
    return planned


def _unit_path(graph: ActivationGraph, start: int, stop: int) -> str:
    """The module path of the unit a checkpointed region is: one unit call, or every part of a nested
    unit's call (its own code and its children's calls: NOTE [nested units] in
    profiler/split_calls.py)."""
    nodes = graph.nodes[start:stop]
    if len(nodes) == 1 and nodes[0].op != GLUE_OP:
        return nodes[0].module_path
    (call,) = {node.part_of for node in nodes}  # CheckpointRule: glue separates units
    first, last = nodes[0], nodes[-1]
    assert first.op == GLUE_OP and last.op == GLUE_OP and first.module_path == last.module_path, call
    return first.module_path
