"""The last level of the capture chain: plan a model by its submodules, running its forward as written.

Why it exists: some root forwards cannot be traced by torch.fx or torch.export (Python control flow
on tensor values, hooks that export would inline). Their submodules can still be checkpointed one at
a time, as `gradient_checkpointing_enable` does, and the planner can still choose which ones from a
measured step. `optimize(..., sharding="fsdp")` plans here directly, because FSDP2's `fully_shard` needs
its blocks called as modules (NOTE [FSDP2] in rewrite/emit.py).

At this level the captured graph is one call of the model (`capture_model_call`), and the profiling step
(profiler/interpreter.py) splits that call at its *units*, as it splits any call it cannot follow (NOTE [split
calls] in simulation/step.py): the model's own code between unit calls (glue) and each unit call are the
nodes of the activation graph, with the model's module paths.

- Units are the root's children, with containers (ModuleList/ModuleDict/Sequential) replaced by their
  children, and a unit that holds most of the parameters replaced by its children too, so that a
  decoder's blocks become units rather than the decoder (`chain.candidate_units`).
- Each unit's call is split at the unit's children in turn (NOTE [nested units] in
  profiler/split_calls.py; not under FSDP, whose units are the modules it shards), so a plan
  checkpoints a unit whole or one of its children.
- The model's own code is never checkpointed, and a unit only when it is called once per step and
  carries no hooks (a replay would run them again), so a checkpointed region is exactly one call of a
  unit or of a unit's child. `rewrite_units` (rewrite/units.py) wraps those in checkpoint on a copy of
  the module tree along their paths, sharing every parameter, buffer and untouched submodule with the
  model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import fx, nn

from planner.capture.records import Capture, CapturePath, GraphCall

__all__ = ["MODEL_CALL", "capture_model_call"]

MODEL_CALL = "_planner_model_call"
"""The target of the one node of a module-level capture, a call of the whole model: its parts carry the
model's own module paths, and its own code is never checkpointed."""


def capture_model_call(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, nested_units: bool
) -> Capture:
    """A graph of one node that calls `model(*args, **kwargs)` as written, for the profiling step to
    split at the model's units (and with `nested_units` at their children too). Its inputs are the
    call's arguments, nested values as they are."""
    holder = nn.Module()
    holder.add_module(MODEL_CALL, model)
    graph = fx.Graph()
    positional = tuple(graph.placeholder(f"arg_{index}") for index in range(len(args)))
    keywords: dict[str, Any] = {name: graph.placeholder(f"kwarg_{name}") for name in kwargs}
    graph.output(graph.call_module(MODEL_CALL, positional, keywords))
    return Capture(
        graph_module=fx.GraphModule(holder, graph, type(model).__name__),
        path=CapturePath.MODULE.value,
        opaque_modules=(MODEL_CALL,),
        call=GraphCall(signature=inspect.signature(model.forward)),
        inputs=(*args, *kwargs.values()),
        nested_units=nested_units,
    )
