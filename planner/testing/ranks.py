"""Run a function on every rank of a real gloo process group on this machine, and collect its results.

Why it exists: the per-rank predictions of `optimize(..., world_size=N, sharding=...)` are checked
against what each rank of a real DDP or FSDP2 step measures (tests/planner/test_rank_memory.py,
bench/rank_memory.py), and the gradient check of tests/planner/test_distributed.py spawns the same
ranks; one harness spawns them all. `run_ranks(function, world_size, *args)` starts `world_size`
processes (spawn, so nothing of the parent's torch state is inherited), each with one intra-op thread
(the tests share a few cores), joins a gloo group on 127.0.0.1 at a free port, calls
`function(rank, *args)` and saves what it returns with `torch.save`; the parent loads each rank's
result, in rank order. Results must
be what `torch.load(weights_only=True)` reads back: tensors, numbers, strings, and lists and dicts of
them. An exception in a rank fails the call with that rank's traceback.

`planned_rank_step` is the rank function of the per-rank memory check (the test and
bench/rank_memory.py): plan the rank's share of a zoo model under an engine (`ENGINES`), wrap
`plan.module` in that engine, run one forward and backward (loss, gathered gradients, block calls),
then measure two Adam steps with `planner.measure`.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import planner
from planner.profiler.measurement import default_loss
from planner.testing.zoo_real import REAL_ZOO, build_call
from planner.zoo import build_model

__all__ = ["ENGINES", "SEED", "free_port", "planned_rank_step", "run_ranks"]

HOST = "127.0.0.1"
SEED = 1234
"""Rank r seeds SEED + r before its forward (dropout), as a one-process reference does for half r."""
ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"sharding": "ddp", "reshard_after_forward": True},
    "fsdp": {"sharding": "fsdp", "reshard_after_forward": True},
    "fsdp-no-reshard": {"sharding": "fsdp", "reshard_after_forward": False},
}
"""The data-parallel engines, by name: `optimize`'s arguments for each (DDP, or FSDP2's `fully_shard`
on every block and then the root, with and without `reshard_after_forward`)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the group's rendezvous)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _rank_main(
    rank: int, function: Callable[..., Any], world_size: int, port: int, out: str, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": HOST, "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = function(rank, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(function: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`function(rank, *args)` on each of `world_size` spawned ranks of a gloo group, its results in
    rank order. `function` and `args` must pickle (a module-level function)."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank_main,
            args=(function, world_size, free_port(), out, args),
            nprocs=world_size,
            start_method="spawn",
        )
        return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


def _blocks(module: torch.nn.Module) -> torch.nn.Sequential | torch.nn.ModuleList:
    """The zoo model's block stack."""
    blocks = module.blocks
    assert isinstance(blocks, torch.nn.Sequential | torch.nn.ModuleList), f"{type(module).__name__}.blocks"
    return blocks


def _count_block_calls(blocks: torch.nn.Sequential | torch.nn.ModuleList) -> list[list[int]]:
    """Calls of each block's first child (a replay calls it again; the block's own hooks do not)."""
    calls: list[list[int]] = [[] for _ in blocks]
    for block, counter in zip(blocks, calls, strict=True):
        first_child = next(iter(block.children()))
        first_child.register_forward_pre_hook(lambda _module, _args, counter=counter: counter.append(1))
    return calls


def _wrapped(module: torch.nn.Module, engine: str, world_size: int) -> torch.nn.Module:
    """`module` under `engine`: DDP, or fully_shard on each block of `module.blocks` and the root."""
    if ENGINES[engine]["sharding"] == "ddp":
        return torch.nn.parallel.DistributedDataParallel(module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    reshard = bool(ENGINES[engine]["reshard_after_forward"])
    for block in _blocks(module):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    return module


def _full_gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, FSDP2's shards gathered (`DTensor.full_tensor`)."""
    return {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for name, p in module.named_parameters()
        if p.grad is not None
    }


def _zoo_model(name: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """A model of planner.zoo or of the real-model zoo (zoo_real), with its example call's arguments."""
    if name in REAL_ZOO:
        call = build_call(name)
        return call.model, call.args
    return build_model(name)


def planned_rank_step(
    rank: int, engine: str, world_size: int, model_name: str = "gpt_tiny", budget_fraction: float = 0.5
) -> dict[str, Any]:
    """Plan rank `rank`'s share of `model_name`'s example batch (a model of either zoo with `.blocks`,
    its first argument split across ranks) at the
    budget `budget_fraction` of the way from the lowest to the no-checkpointing peak, train
    `plan.module` under `engine`, and report what it measured against what was predicted."""
    model, inputs = _zoo_model(model_name)
    batch = inputs[0].chunk(world_size)[rank]
    profiled = planner.profile(model, (batch,), world_size=world_size, **ENGINES[engine])
    reference = profiled.plan(budget_bytes=2**40)
    span_bytes = reference.baseline_peak_bytes - reference.min_peak_bytes
    budget_bytes = reference.min_peak_bytes + int(budget_fraction * span_bytes)
    plan = profiled.plan(budget_bytes=budget_bytes)
    assert plan.module is not None
    checkpointed = {module for region in plan.regions for module in region.modules}
    by_modules = ENGINES[engine]["sharding"] == "fsdp"  # planned by submodules: its blocks are modules
    calls = _count_block_calls(_blocks(plan.module)) if by_modules else []
    wrapped = _wrapped(plan.module, engine, world_size)
    torch.manual_seed(SEED + rank)
    loss = default_loss(wrapped(batch))
    loss.backward()
    gradients = _full_gradients(plan.module)
    call_counts = [len(counter) for counter in calls]
    wrapped.zero_grad(set_to_none=True)
    measured = planner.measure(wrapped, (batch,))
    return {
        "loss": loss.detach(),
        "gradients": gradients,
        "regions": len(plan.regions),
        "calls": call_counts,
        "expected_calls": [2 if f"blocks.{n}" in checkpointed else 1 for n in range(len(calls))],
        "budget_bytes": budget_bytes,
        "min_peak_bytes": reference.min_peak_bytes,
        "baseline_peak_bytes": reference.baseline_peak_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": measured.peak_in(plan.graph.memory_counting),
        "measured_phase_peak_bytes": measured.phase_peak_bytes,
    }
