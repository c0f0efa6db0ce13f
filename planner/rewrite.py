"""Emits the checkpointed module for a schedule.

Each CHECKPOINT region of the traced graph is fused into one submodule call (`fuse_by_partitions`)
that runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)`.
That choice answers three traps users hit by hand:

- non-reentrant checkpointing computes gradients for parameters even when no input requires grad, so
  an input without grad never freezes the first block's weights (reentrant checkpointing does);
- the RNG state is restored for the replay, so dropout draws the same mask twice;
- buffers (BatchNorm running statistics) are saved before the replay and restored after it, so they
  are updated once per step, as without checkpointing.

The result is an instance of a subclass of the model's own class that shares the original's
submodules, parameters and buffers (so `state_dict` keys, `isinstance` and the optimizer's parameter
list are unchanged). Only in training with grad enabled does it run the planned graph; in eval or
under `no_grad` it runs the model's own forward, since nothing is saved for backward there.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.checkpoint import checkpoint

from planner.ir import ActivationGraph, Schedule

__all__ = ["CheckpointedRegion", "rewrite", "planned_graph_of"]

SPLIT_ATTRIBUTE = "_planner_split"
REGION_PREFIX = "checkpointed_region_"
MODEL_FORWARD_ATTRIBUTE = "_planner_model_forward"


@contextmanager
def _buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Undo any buffer update made inside the block (a checkpoint replay must not count twice)."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


class CheckpointedRegion(torch.nn.Module):
    """Runs `body` under non-reentrant checkpointing with RNG and buffer state preserved."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.has_buffers = any(True for _ in body.buffers())

    def _contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        replay = _buffers_restored(self.body) if self.has_buffers else nullcontext()
        return nullcontext(), replay

    def forward(self, *args: Any) -> Any:
        return checkpoint(
            self.body, *args, use_reentrant=False, preserve_rng_state=True, context_fn=self._contexts
        )


def _split(graph_module: fx.GraphModule, graph: ActivationGraph, schedule: Schedule) -> fx.GraphModule:
    """Fuse each CHECKPOINT region into one call of a CheckpointedRegion; leave the rest inline.

    Stored regions stay in the top-level graph, whose generated code frees each value after its last
    use, so their memory behaves exactly as in the original model. (Wrapping them in submodules too
    would keep their inputs alive for the whole call.)
    """
    split = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph), type(graph_module).__name__)
    by_name = {node.name: node for node in split.graph.nodes}
    partitions: list[dict[fx.Node, int | None]] = [
        {by_name[node.name]: None for node in graph.nodes[region.start : region.stop] if node.name in by_name}
        for region in schedule.checkpointed
    ]
    partitions = [partition for partition in partitions if partition]
    fuse_by_partitions(split, partitions, prefix=REGION_PREFIX, always_return_tuple=True)
    for number in range(len(partitions)):
        name = f"{REGION_PREFIX}{number}"
        setattr(split, name, CheckpointedRegion(getattr(split, name)))
    split.recompile()
    return split


def _planned_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    if self.training and torch.is_grad_enabled():
        return getattr(self, SPLIT_ATTRIBUTE)(*args, **kwargs)
    return getattr(type(self), MODEL_FORWARD_ATTRIBUTE)(self, *args, **kwargs)


def rewrite(
    model: torch.nn.Module, graph_module: fx.GraphModule, graph: ActivationGraph, schedule: Schedule
) -> torch.nn.Module:
    """A drop-in replacement for `model` that checkpoints as `schedule` says."""
    split = _split(graph_module, graph, schedule)
    planned_class = type(
        f"Planned{type(model).__name__}",
        (type(model),),
        {"forward": _planned_forward, MODEL_FORWARD_ATTRIBUTE: type(model).forward},
    )
    planned = copy.copy(model)
    planned.__class__ = planned_class
    object.__setattr__(planned, SPLIT_ATTRIBUTE, split)
    return planned


def planned_graph_of(module: torch.nn.Module) -> fx.GraphModule:
    """The split graph a planned module runs in training (for inspection and tests)."""
    return getattr(module, SPLIT_ATTRIBUTE)
