"""`plan.module` under DistributedDataParallel: 2 processes with gloo on the CPU.

Each rank plans its model for its own half of the batch and trains it under DDP; the averaged
gradients must equal the single-process gradients of the mean of the two halves' losses (dropout
included: each rank seeds as the reference does for that half). The tied-weight language model is
the case that makes reentrant checkpointing fail with "marked ready twice".
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import planner
from planner.profiler.measurement import default_loss
from planner.testing.zoo_real import build_call

WORLD_SIZE = 2
MODEL = "tied_lm"
SEED = 1234


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _half(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch.chunk(WORLD_SIZE)[rank]


def _rank_step(rank: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        call = build_call(MODEL)
        tokens = _half(call.args[0], rank)
        reference = planner.optimize(call.model, (tokens,), budget_bytes=2**40, world_size=WORLD_SIZE)
        budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
        plan = planner.optimize(call.model, (tokens,), budget_bytes=budget, world_size=WORLD_SIZE)
        assert plan.module is not None and plan.regions, "the plan should checkpoint something"
        model = torch.nn.parallel.DistributedDataParallel(plan.module)
        torch.manual_seed(SEED + rank)
        default_loss(model(tokens)).backward()
        gradients = {name: p.grad for name, p in plan.module.named_parameters() if p.grad is not None}
        torch.save(gradients, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_equal_single_process_gradients() -> None:
    call = build_call(MODEL)
    model = copy.deepcopy(call.model)
    for rank in range(WORLD_SIZE):
        torch.manual_seed(SEED + rank)
        (default_loss(model(_half(call.args[0], rank))) / WORLD_SIZE).backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_step, args=(_free_port(), out), nprocs=WORLD_SIZE, start_method="spawn")
        for rank in range(WORLD_SIZE):
            actual = torch.load(Path(out) / f"rank{rank}.pt")
            assert actual.keys() == expected.keys()
            for name, gradient in expected.items():
                torch.testing.assert_close(
                    actual[name], gradient, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
                )
