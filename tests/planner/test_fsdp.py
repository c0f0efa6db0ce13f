"""`plan.module` under FSDP2 `fully_shard`: 2 processes with gloo on the CPU, and the refusals.

Each rank plans gpt_tiny for its half of the batch with `sharding="fsdp"`, applies `fully_shard` to
every block of `plan.module` and then to `plan.module`, and runs one step; the gathered gradients
(`DTensor.full_tensor()`, averaged over ranks by the reduce-scatter) must equal the single-process
gradients of the mean of the two halves' losses, dropout included (each rank seeds as the reference
does for its half). A forward pre-hook on each block's first submodule counts its calls: checkpointed
blocks run twice (forward and replay), the others once.

A plan whose module runs a captured graph cannot work under `fully_shard` (see NOTE [FSDP2] in
rewrite/emit.py); it must say so, as must `optimize` given a model that `fully_shard` already wraps. Those
checks need only a one-rank process group.
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import planner
from planner.profiler.measurement import default_loss
from planner.zoo import build_model

WORLD_SIZE = 2
MODEL = "gpt_tiny"
SEED = 1234


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _half(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch.chunk(WORLD_SIZE)[rank]


def _fsdp_plan(model: torch.nn.Module, tokens: torch.Tensor, budget_bytes: int) -> planner.Plan:
    return planner.optimize(
        model, (tokens,), budget_bytes=budget_bytes, world_size=WORLD_SIZE, sharding="fsdp"
    )


def _mid_budget_plan(model: torch.nn.Module, tokens: torch.Tensor) -> planner.Plan:
    reference = _fsdp_plan(model, tokens, 2**40)
    return _fsdp_plan(model, tokens, (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2)


def _count_block_calls(blocks: torch.nn.Module) -> dict[str, list[int]]:
    """Calls of each block's first submodule (its replay calls it too; the block's own hooks it does not)."""
    calls: dict[str, list[int]] = {}
    for index, block in enumerate(blocks):
        counter = calls.setdefault(f"blocks.{index}", [])
        block.attention_norm.register_forward_pre_hook(
            lambda _module, _args, counter=counter: counter.append(1)
        )
    return calls


def _rank_step(rank: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        model, inputs = build_model(MODEL)
        tokens = _half(inputs[0], rank)
        plan = _mid_budget_plan(model, tokens)
        assert plan.module is not None and plan.regions, "the plan should checkpoint something"
        assert plan.capture == "module (fsdp units)", plan.capture
        checkpointed = {module for region in plan.regions for module in region.modules}
        calls = _count_block_calls(plan.module.blocks)
        for block in plan.module.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(plan.module, mesh=mesh)
        torch.manual_seed(SEED + rank)
        loss = default_loss(plan.module(tokens))
        loss.backward()
        expected_calls = {name: 2 if name in checkpointed else 1 for name in calls}
        assert {name: len(counter) for name, counter in calls.items()} == expected_calls
        gradients = {name: p.grad.full_tensor() for name, p in plan.module.named_parameters()}
        torch.save({"loss": loss.detach(), "gradients": gradients}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp_gradients_equal_single_process_gradients() -> None:
    model, inputs = build_model(MODEL)
    reference = copy.deepcopy(model)
    losses = []
    for rank in range(WORLD_SIZE):
        torch.manual_seed(SEED + rank)
        loss = default_loss(reference(_half(inputs[0], rank)))
        (loss / WORLD_SIZE).backward()
        losses.append(loss.detach())
    expected = {name: p.grad for name, p in reference.named_parameters()}

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_step, args=(_free_port(), out), nprocs=WORLD_SIZE, start_method="spawn")
        for rank in range(WORLD_SIZE):
            actual = torch.load(Path(out) / f"rank{rank}.pt")
            torch.testing.assert_close(actual["loss"], losses[rank], rtol=1e-6, atol=0.0)
            assert actual["gradients"].keys() == expected.keys()
            for name, gradient in expected.items():
                torch.testing.assert_close(
                    actual["gradients"][name], gradient, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
                )


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_captured_graph_plan_refuses_to_train_under_fully_shard(one_rank_mesh: DeviceMesh) -> None:
    model, inputs = build_model(MODEL)
    plan = planner.optimize(model, inputs, budget_bytes=2**40, solver="none")
    assert plan.module is not None and plan.capture == "fx"
    fully_shard(plan.module, mesh=one_rank_mesh)
    with pytest.raises(planner.UnsupportedModel, match="sharding='fsdp'"):
        plan.module(*inputs)


def test_optimize_refuses_a_model_that_fully_shard_already_wraps(one_rank_mesh: DeviceMesh) -> None:
    model, inputs = build_model(MODEL)
    fully_shard(model.blocks[0], mesh=one_rank_mesh)
    with pytest.raises(planner.UnsupportedModel, match="'blocks.0'.*plan the unsharded model"):
        planner.optimize(model, inputs, budget_bytes=2**40, sharding="fsdp")
