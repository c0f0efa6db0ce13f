"""Run a function on every rank of a real gloo process group on this machine, and collect its results.

Why it exists: the per-rank predictions of `optimize(..., world_size=N, sharding=...)` are checked
against what each rank of a real DDP or FSDP2 step measures (tests/planner/test_rank_memory.py), and
the gradient checks of tests/planner/test_distributed.py and test_fsdp.py spawn the same ranks; one
harness spawns them all. `run_ranks(function, world_size, *args)` starts `world_size` processes (spawn,
so nothing of the parent's torch state is inherited), each with one intra-op thread (the tests share a
few cores), joins a gloo group on 127.0.0.1 at a free port, calls `function(rank, *args)` and saves
what it returns with `torch.save`; the parent loads each rank's result, in rank order. Results must
be what `torch.load(weights_only=True)` reads back: tensors, numbers, strings, and lists and dicts of
them. An exception in a rank fails the call with that rank's traceback.
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

__all__ = ["free_port", "run_ranks"]

HOST = "127.0.0.1"


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
