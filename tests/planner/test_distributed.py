"""`plan.module` under DistributedDataParallel: 2 processes with gloo on the CPU.

Each rank plans its model for its own half of the batch and trains it under DDP; the averaged
gradients must equal the single-process gradients of the mean of the two halves' losses (dropout
included: each rank seeds as the reference does for that half). The tied-weight language model is
the case that makes reentrant checkpointing fail with "marked ready twice". Each rank's measured peak
under DDP against its prediction is in tests/planner/test_rank_memory.py.
"""

from __future__ import annotations

import copy

import torch

import planner
from planner.profiler.measurement import default_loss
from planner.testing.ranks import run_ranks
from planner.testing.zoo_real import build_call

WORLD_SIZE = 2
MODEL = "tied_lm"
SEED = 1234


def _half(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch.chunk(WORLD_SIZE)[rank]


def _rank_step(rank: int) -> dict[str, torch.Tensor]:
    call = build_call(MODEL)
    tokens = _half(call.args[0], rank)
    reference = planner.optimize(call.model, (tokens,), budget_bytes=2**40, world_size=WORLD_SIZE)
    budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    plan = planner.optimize(call.model, (tokens,), budget_bytes=budget, world_size=WORLD_SIZE)
    assert plan.module is not None and plan.regions, "the plan should checkpoint something"
    model = torch.nn.parallel.DistributedDataParallel(plan.module)
    torch.manual_seed(SEED + rank)
    default_loss(model(tokens)).backward()
    return {name: p.grad for name, p in plan.module.named_parameters() if p.grad is not None}


def test_ddp_gradients_equal_single_process_gradients() -> None:
    call = build_call(MODEL)
    model = copy.deepcopy(call.model)
    for rank in range(WORLD_SIZE):
        torch.manual_seed(SEED + rank)
        (default_loss(model(_half(call.args[0], rank))) / WORLD_SIZE).backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    for rank, actual in enumerate(run_ranks(_rank_step, WORLD_SIZE)):
        assert actual.keys() == expected.keys()
        for name, gradient in expected.items():
            torch.testing.assert_close(
                actual[name], gradient, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
            )
