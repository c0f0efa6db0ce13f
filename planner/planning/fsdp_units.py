"""What `fully_shard` makes of a model: its units and what each holds on one rank.

Why it exists: `optimize(..., sharding="fsdp")` plans one rank of FSDP2, whose memory depends on
units the planner never sees run. Applied as people apply it (to each block of the model's longest
ModuleList or Sequential, then to the model), `fully_shard` gathers each unit's parameters whole
for its forward and backward and keeps a padded dim-0 shard of each between them. `fsdp_units` works
those units and their bytes out from the model alone, for profiler/sharding.py to add to the profiled
graph (NOTE [FSDP2 per rank] there); planning/model.py calls it when it profiles for FSDP.
"""

from __future__ import annotations

import torch

from planner.ir import MemoryCounting
from planner.profiler.sharding import FsdpUnit, FsdpUnits
from planner.report.blocks import longest_block_stack

__all__ = ["fsdp_units"]


def fsdp_units(
    model: torch.nn.Module,
    *,
    world_size: int,
    counting: MemoryCounting = MemoryCounting.BLOCKS,
    reshard_after_forward: bool = True,
) -> FsdpUnits:
    """The units `fully_shard` makes of `model` when applied to each block of its longest
    ModuleList/Sequential and then to the model (the root: the parameters outside the blocks, or the
    whole model when it has no block stack), with what each holds unsharded on one of `world_size`
    ranks (NOTE [FSDP2 per rank] in profiler/sharding.py)."""
    stack = longest_block_stack(model)
    prefix = f"{stack[0]}." if stack is not None and stack[0] else ""
    seen: set[int] = set()
    blocks = tuple(
        _fsdp_unit(f"{prefix}{number}", parameters, world_size, counting)
        for number, block in enumerate(list(stack[1]) if stack is not None else [])
        if (parameters := _new_parameters(block, seen))  # a block without parameters gathers nothing
    )
    root = _fsdp_unit("", _new_parameters(model, seen), world_size, counting)
    unsharded_bytes = sum(unit.parameter_bytes for unit in (root, *blocks))
    return FsdpUnits(
        root=root, blocks=blocks, reshard_after_forward=reshard_after_forward, unsharded_bytes=unsharded_bytes
    )


def _new_parameters(module: torch.nn.Module, seen: set[int]) -> list[torch.nn.Parameter]:
    """`module`'s parameters not already in `seen` (tied weights belong to the first unit)."""
    found = [parameter for parameter in module.parameters() if id(parameter) not in seen]
    seen.update(id(parameter) for parameter in found)
    return found


def _fsdp_unit(
    module_path: str, parameters: list[torch.nn.Parameter], world_size: int, counting: MemoryCounting
) -> FsdpUnit:
    """One unit: each parameter unsharded, its dim-0 shards padded to an even split
    (`_chunk_with_empty` in torch/distributed/fsdp/_fully_shard/_fsdp_common.py) and one flat buffer
    of world_size of them."""
    padded_shard_bytes = [_padded_shard_bytes(parameter, world_size) for parameter in parameters]
    local_shard_bytes = [
        min(padded, parameter.numel() * parameter.element_size())
        for padded, parameter in zip(padded_shard_bytes, parameters, strict=True)
    ]
    gathered_bytes = world_size * sum(padded_shard_bytes)
    return FsdpUnit(
        module_path=module_path,
        parameter_bytes=sum(counting.of(p.numel() * p.element_size()) for p in parameters),
        gathered_bytes=counting.of(gathered_bytes) if gathered_bytes else 0,
        shard_bytes=sum(counting.of(size) for size in padded_shard_bytes if size),
        reduced_bytes=counting.of(sum(padded_shard_bytes)) if padded_shard_bytes else 0,
        local_shard_bytes=sum(counting.of(size) for size in local_shard_bytes if size),
    )


def _padded_shard_bytes(parameter: torch.nn.Parameter, world_size: int) -> int:
    """One rank's dim-0 shard of `parameter`, padded to ceil(rows / world_size) rows."""
    rows = parameter.shape[0] if parameter.dim() > 0 else 1
    row_bytes = parameter.numel() * parameter.element_size() // max(rows, 1)
    return -(-rows // world_size) * row_bytes
