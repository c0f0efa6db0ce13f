"""`plan.module` under FSDP2 `fully_shard`: the refusals.

`plan.module` trained under `fully_shard` in two gloo processes (loss, gradients, block calls and each
rank's measured peak against its prediction, with and without `reshard_after_forward`) is in
tests/planner/test_rank_memory.py.

A plan whose module runs a captured graph cannot work under `fully_shard` (see NOTE [FSDP2] in
rewrite/emit.py); it must say so, as must `optimize` given a model that `fully_shard` already wraps. Those
checks need only a one-rank process group.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import planner
from planner.testing.ranks import free_port
from planner.zoo import build_model

MODEL = "gpt_tiny"


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
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
