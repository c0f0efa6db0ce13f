"""Per-rank memory under data parallelism: how DDP and FSDP2 change what one device holds.

Why it exists: the budget is one device's memory, and in data-parallel training what a device holds
besides activations depends on how the model is replicated. The activation graph is profiled in one
process on the per-rank batch; `shard_graph` turns its accounting into one rank's of `world_size`
(torch-free, like the solvers):

- `"ddp"` (`DistributedDataParallel`): every rank holds full parameters, gradients and optimizer
  state, and DDP adds its gradient buckets: one flat copy of every gradient, allocated when the model
  is wrapped and kept for the whole run. Counted with the resident buffers, and measured with DDP's
  defaults; with `gradient_as_bucket_view=True` the gradients are views of the buckets, so this counts
  them twice (an overestimate by the gradients, not measured).
- `"fsdp"` (FSDP2 `fully_shard` on each block and then the root): parameters, gradients and optimizer
  state are split evenly, so each rank holds 1/world_size of them, and around each unit's forward and
  backward the rank holds what NOTE [FSDP2 per rank] lists, from the unit sizes `FsdpUnits` gives.

Measured, not assumed: tests/planner/test_rank_memory.py runs each engine in two gloo processes on the
CPU, trains `plan.module` under it, and measures each rank's peak with the live-storage tracker in that
rank (`planner.measure`, which counts FSDP2's resized storages and DDP's buckets, see
profiler/rank_memory.py); every rank's peak is within 2 % of this module's prediction (docs/memory.md
has the figures). `world_size=1` leaves a graph unchanged.

NOTE [FSDP2 per rank]: read from torch/distributed/fsdp/_fully_shard/ (torch 2.13) and checked by the
measurement above. Per unit (a block, or the root's own parameters), in the counting of the graph:
`parameter_bytes` is its unsharded parameters (`FSDPParam.all_gather_outputs`, one storage per
parameter, freed and re-allocated by `free_storage`/`alloc_storage` resizing it), `gathered_bytes` one
flat buffer of world_size padded shards (the all-gather output of `foreach_all_gather`, and the same
size again as the reduce-scatter input of `foreach_reduce`).
- Between steps (`FsdpUnit.shard_bytes`, `reduced_bytes`, `local_shard_bytes`): each parameter's
  padded shard in a storage of its own (`FSDPParam._sharded_param_data`); the sharded gradients of a
  unit are views of one reduce-scatter output (`foreach_reduce`: `torch.as_strided(reduce_output,
  ...)`); Adam's moments are `zeros_like` the sharded DTensor, a local shard each, while its `step`
  scalars are whole on every rank. Counting each storage in 512-byte blocks, these differ from the
  graph's bytes divided by world_size by a block per small parameter (gpt_tiny: 70 KB, 0.3 %).
- Forward (`FSDPParamGroup.pre_forward` -> `unshard`, `wait_for_unshard`): the unit's parameters and
  its all-gather buffer, which `wait_for_unshard` keeps in `comm_ctx.all_gather_state` until the next
  unit's copy-out (to overlap the copy-out with the next all-gather). The root's parameters are
  gathered at its pre-forward and stay until its post-forward, so they are held through every block.
  With `reshard_after_forward=True` a block's parameters are freed at its post-forward (`reshard`);
  with False they stay until its post-backward, so every block run so far holds them.
- Backward (`pre_backward`): the root's parameters again from the first backward node on; a block's
  parameters while it runs (gathered again unless still held), and the all-gather buffer of the block
  that runs next in backward, prefetched (`_backward_prefetch`). Its full gradients exist until its
  `post_backward` reduce-scatters them; `foreach_reduce`'s input buffer stays in
  `comm_ctx.reduce_scatter_states` until the next unit's post-backward
  (`reduce_scatter_max_input_buffers`, 1 by default), so the block before it in backward holds it too.
  The root's full gradients (embeddings, the head) exist from their node on until the root's
  post-backward at the end of the backward.
- The loss, outside the model, runs after the root's post-forward, which reshards the root (with
  `reshard_after_forward=True`) and frees the last all-gather buffer (`FSDPState._post_forward`), and
  its backward before the root's pre-backward: with resharding nothing is gathered then.
The gradients each node makes are the graph's own, divided by world_size, plus what is unsharded
of them until the reduce-scatter, as above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.ir import ActivationGraph, Node, Sharding

__all__ = ["FsdpUnit", "FsdpUnits", "shard_graph"]

LOSS_OP = "loss_fn"
"""`Node.op` of the loss (profiler/interpreter.py), which runs outside the model and its units' hooks."""


@dataclass(frozen=True)
class FsdpUnit:
    """What one `fully_shard` unit holds unsharded on a rank, counted as its graph counts storages."""

    module_path: str
    """The block's path in the model (`blocks.3`); "" for the root's own parameters."""
    parameter_bytes: int
    """Its parameters, unsharded (one storage each)."""
    gathered_bytes: int
    """One flat buffer of world_size padded shards: the all-gather output, and the reduce-scatter input."""
    shard_bytes: int = 0
    """This rank's padded shards of its parameters (one storage each, `FSDPParam._sharded_param_data`)."""
    reduced_bytes: int = 0
    """This rank's padded shards in one storage: `foreach_reduce`'s reduce-scatter output, of which every
    sharded gradient of the unit is a view (`torch.as_strided(reduce_output, ...)`)."""
    local_shard_bytes: int = 0
    """The first rank's shards without padding (one storage each): what a state made like a sharded
    parameter holds (Adam's moments, `zeros_like` of the DTensor). The first rank's is the largest."""


@dataclass(frozen=True)
class FsdpUnits:
    """The units of a model under FSDP2: its blocks in forward order, and the root."""

    root: FsdpUnit
    blocks: tuple[FsdpUnit, ...]
    reshard_after_forward: bool = True
    unsharded_bytes: int = 0
    """Every parameter unsharded, counted one storage each (the profiled graph's parameter bytes)."""

    @property
    def units(self) -> tuple[FsdpUnit, ...]:
        """The root and every block."""
        return (self.root, *self.blocks)

    def block_index(self, node: Node) -> int | None:
        """Which block a node runs in (None for the root's own code)."""
        for index, block in enumerate(self.blocks):
            if node.module_path == block.module_path or node.module_path.startswith(block.module_path + "."):
                return index
        return None


def _per_rank(size_bytes: int, world_size: int) -> int:
    """A rank's share of an evenly split tensor set (the last rank's shard may be padded: round up)."""
    return -(-size_bytes // world_size)


def shard_graph(
    graph: ActivationGraph, *, world_size: int, sharding: Sharding, units: FsdpUnits | None = None
) -> ActivationGraph:
    """`graph` with its memory as one of `world_size` data-parallel ranks holds it (FSDP needs `units`)."""
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
    if units is None:
        raise ValueError("sharding='fsdp' needs the model's FSDP units")
    sharded_static = dataclasses.replace(
        static,
        parameter_bytes=static.parameter_bytes
        - units.unsharded_bytes
        + sum(unit.shard_bytes for unit in units.units),
        gradient_bytes=_sharded_gradient_bytes(static.gradient_bytes, units, world_size),
        accumulated_gradient_bytes=_sharded_gradient_bytes(
            static.accumulated_gradient_bytes, units, world_size
        ),
        resident_gradient_bytes=_sharded_gradient_bytes(static.resident_gradient_bytes, units, world_size),
        forward_gradient_bytes=_sharded_gradient_bytes(static.forward_gradient_bytes, units, world_size),
        optimizer_state_bytes=_sharded_optimizer_state_bytes(static.optimizer_state_bytes, units, world_size),
        optimizer_step_workspace_bytes=_per_rank(static.optimizer_step_workspace_bytes, world_size),
    )
    blocks_order = _node_blocks(graph, units)
    forward = _forward_unit_bytes(graph, units, blocks_order)
    backward = _backward_unit_bytes(graph, units, blocks_order, world_size)
    for index, node in enumerate(graph.nodes):
        if node.op == LOSS_OP:
            forward[index] = backward[index] = _after_the_model_bytes(units)
    nodes = tuple(
        dataclasses.replace(
            node,
            parameter_gradient_bytes=_per_rank(node.parameter_gradient_bytes, world_size),
            forward_workspace_bytes=node.forward_workspace_bytes + forward[index],
            backward_workspace_bytes=node.backward_workspace_bytes + backward[index],
            backward_points=tuple(
                (workspace_bytes + backward[index], freed) for workspace_bytes, freed in node.backward_points
            ),
        )
        for index, node in enumerate(graph.nodes)
    )
    return dataclasses.replace(graph, nodes=nodes, static=sharded_static)


def _after_the_model_bytes(units: FsdpUnits) -> int:
    """What FSDP2 holds unsharded while the loss runs, after the root's post-forward and before its
    pre-backward: with resharding nothing (the root's post-forward reshards its parameters and frees
    the last all-gather buffer, `FSDPState._post_forward`), without it every unit's parameters."""
    if units.reshard_after_forward:
        return 0
    return sum(unit.parameter_bytes for unit in units.units)


def _sharded_gradient_bytes(gradient_bytes: int, units: FsdpUnits, world_size: int) -> int:
    """A rank's sharded gradients: one reduce-scatter output per unit when every parameter has a
    gradient; else (frozen parameters) an even split."""
    if gradient_bytes != units.unsharded_bytes:
        return _per_rank(gradient_bytes, world_size)
    return sum(unit.reduced_bytes for unit in units.units)


def _sharded_optimizer_state_bytes(state_bytes: int, units: FsdpUnits, world_size: int) -> int:
    """A rank's optimizer state: torch.optim's states are made like their parameter (the sharded
    DTensor: a local shard each) or are scalars (Adam's `step`, on every rank whole). The graph's state
    is `copies` parameter-shaped copies of every parameter and what is left is scalars; a state of
    another shape (Adafactor's factors) splits evenly instead."""
    if units.unsharded_bytes <= 0:
        return _per_rank(state_bytes, world_size)
    copies = state_bytes // units.unsharded_bytes
    scalar_bytes = state_bytes - copies * units.unsharded_bytes
    if copies == 0 or scalar_bytes > units.unsharded_bytes // 2:
        return _per_rank(state_bytes, world_size)
    return copies * sum(unit.local_shard_bytes for unit in units.units) + scalar_bytes


def _node_blocks(graph: ActivationGraph, units: FsdpUnits) -> list[int | None]:
    """The block each node runs in, None for the root's own code. A node between two nodes of one
    block runs in it too: the block's own code between its children's calls, which a capture by
    submodules records as glue of the model's call (a block that is a Sequential)."""
    blocks_order = [units.block_index(node) for node in graph.nodes]
    positions = [position for position, index in enumerate(blocks_order) if index is not None]
    for before, after in zip(positions, positions[1:], strict=False):
        if blocks_order[before] == blocks_order[after]:
            blocks_order[before + 1 : after] = [blocks_order[before]] * (after - before - 1)
    return blocks_order


def _forward_unit_bytes(
    graph: ActivationGraph, units: FsdpUnits, blocks_order: list[int | None]
) -> list[int]:
    """Per node, what FSDP2 holds unsharded while its forward runs (NOTE [FSDP2 per rank])."""
    held = []
    kept_bytes = 0  # blocks' parameters left unsharded after their forward (reshard_after_forward=False)
    last_gathered = units.root.gathered_bytes  # the all-gather buffer kept until the next copy-out
    for position, index in enumerate(blocks_order):
        if index is None:
            held.append(units.root.parameter_bytes + kept_bytes + last_gathered)
            continue
        block = units.blocks[index]
        last_gathered = block.gathered_bytes
        held.append(units.root.parameter_bytes + kept_bytes + block.parameter_bytes + block.gathered_bytes)
        if not units.reshard_after_forward and index not in blocks_order[position + 1 :]:
            kept_bytes += block.parameter_bytes
    return held


def _backward_unit_bytes(
    graph: ActivationGraph, units: FsdpUnits, blocks_order: list[int | None], world_size: int
) -> list[int]:
    """Per node, what FSDP2 holds beyond the sharded state while its backward runs, walking the
    backward from the last node (NOTE [FSDP2 per rank])."""
    held = [0] * len(graph.nodes)
    root_gradient_bytes = 0  # the root's full gradients made so far, less the shard the graph counts
    reduce_scatter_bytes = 0  # the input buffer of the last block reduced, kept until the next one's
    block_gradient_bytes = 0  # the full gradients of the block running, made so far, less its shard
    done: set[int] = set()  # blocks whose backward has run (resharded)
    previous: int | None = None
    for position in reversed(range(len(graph.nodes))):
        node, index = graph.nodes[position], blocks_order[position]
        if previous is not None and index != previous:
            reduce_scatter_bytes = units.blocks[previous].gathered_bytes
            block_gradient_bytes = 0
            done.add(previous)
        previous = index
        unsharded_share = node.parameter_gradient_bytes - _per_rank(node.parameter_gradient_bytes, world_size)
        if index is None:
            root_gradient_bytes += unsharded_share
        else:
            block_gradient_bytes += unsharded_share
        held[position] = (
            units.root.parameter_bytes
            + _held_blocks_bytes(units, index, done)
            + _next_in_backward(blocks_order, position, units)
            + reduce_scatter_bytes
            + block_gradient_bytes
            + root_gradient_bytes
        )
    return held


def _held_blocks_bytes(units: FsdpUnits, index: int | None, done: set[int]) -> int:
    """Unsharded block parameters while a node of block `index` (None: the root) runs its backward:
    the block's own, or, without resharding after forward, every block whose backward has not run."""
    if not units.reshard_after_forward:
        return sum(block.parameter_bytes for number, block in enumerate(units.blocks) if number not in done)
    return units.blocks[index].parameter_bytes if index is not None else 0


def _next_in_backward(blocks_order: list[int | None], position: int, units: FsdpUnits) -> int:
    """The all-gather buffer of the block whose backward comes next, prefetched (nothing to gather
    when its parameters were never resharded)."""
    if not units.reshard_after_forward:
        return 0
    current = blocks_order[position]
    for index in reversed(blocks_order[:position]):
        if index is not None and index != current:
            return units.blocks[index].gathered_bytes
    return 0
