"""Per-rank memory under data parallelism: how DDP and FSDP change what one device holds.

Why it exists: the budget is one device's memory, and in data-parallel training what a device holds
besides activations depends on how the model is replicated. The activation graph is profiled in one
process on the per-rank batch; `shard_graph` rescales the static part of its accounting to one rank
of `world_size` (torch-free, like the solvers):

- `"ddp"` (`DistributedDataParallel`): every rank holds full parameters, gradients and optimizer
  state, and DDP adds its gradient buckets: one flat copy of every gradient, allocated when the model
  is wrapped and kept for the whole run (also with `gradient_as_bucket_view=True`, where the gradients
  live in the buckets). Counted with the resident buffers.
- `"fsdp"` (FULL_SHARD, FSDP2 `fully_shard` on each block and the root): parameters, gradients and
  optimizer state are split evenly, so each rank holds 1/world_size of them; while a block runs its
  parameters are all-gathered in full, and in backward its full gradients exist until they are
  reduce-scattered. Counted as one unit's parameters (`unit_parameter_bytes`, the largest block or the
  root's own parameters) of workspace at every node, forward and backward.

These are accounting rules, not measurements: the planner's CPU tracker cannot see DDP's buckets
(they exist before a step starts) or an all-gather's buffers on another rank, so the per-rank
figures are predictions with the stated model, and `world_size=1` leaves a graph unchanged.
"""

from __future__ import annotations

import dataclasses

from planner.ir import ActivationGraph, Sharding

__all__ = ["shard_graph"]


def _per_rank(size_bytes: int, world_size: int) -> int:
    """A rank's share of an evenly split tensor set (the last rank's shard may be padded: round up)."""
    return -(-size_bytes // world_size)


def shard_graph(
    graph: ActivationGraph, *, world_size: int, sharding: Sharding, unit_parameter_bytes: int = 0
) -> ActivationGraph:
    """`graph` with its static memory as one of `world_size` data-parallel ranks holds it."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if world_size == 1:
        return graph
    static = graph.static
    if sharding is Sharding.DDP:
        buckets_bytes = static.gradient_bytes
        return dataclasses.replace(
            graph, static=dataclasses.replace(static, buffer_bytes=static.buffer_bytes + buckets_bytes)
        )
    sharded_static = dataclasses.replace(
        static,
        parameter_bytes=_per_rank(static.parameter_bytes, world_size),
        gradient_bytes=_per_rank(static.gradient_bytes, world_size),
        accumulated_gradient_bytes=_per_rank(static.accumulated_gradient_bytes, world_size),
        resident_gradient_bytes=_per_rank(static.resident_gradient_bytes, world_size),
        forward_gradient_bytes=_per_rank(static.forward_gradient_bytes, world_size),
        optimizer_state_bytes=_per_rank(static.optimizer_state_bytes, world_size),
        optimizer_step_workspace_bytes=_per_rank(static.optimizer_step_workspace_bytes, world_size),
    )
    nodes = tuple(
        dataclasses.replace(
            node,
            parameter_gradient_bytes=_per_rank(node.parameter_gradient_bytes, world_size),
            forward_workspace_bytes=node.forward_workspace_bytes + unit_parameter_bytes,
            backward_workspace_bytes=node.backward_workspace_bytes + unit_parameter_bytes,
            backward_points=tuple(
                (workspace_bytes + unit_parameter_bytes, freed)
                for workspace_bytes, freed in node.backward_points
            ),
        )
        for node in graph.nodes
    )
    return dataclasses.replace(graph, nodes=nodes, static=sharded_static)
