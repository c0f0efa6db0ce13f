"""Per-rank plans under tensor parallelism, measured in real gloo process groups of 2 ranks on the CPU.

Each rank splits `LlamaStack` by torchtitan's Megatron plan (planner/testing/tensor_parallel.py),
plans it with `tensor_parallel=mesh` at its lowest achievable peak and half way to no checkpointing,
and measures each plan with the live-storage tracker inside the rank (`planner.measure`, 512-byte
blocks). Every rank must get the same schedule, measure at most its budget and within 2 % of its
prediction, and compute the unplanned tensor parallel run's loss and gradients; the lowest achievable
peak must be at most what `checkpoint_wrapper` on every block measures, and each rank must count its
DTensor parameters as their local shards (NOTE [wrapper subclasses] in profiler/counting.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

import planner
from planner.testing.ranks import free_port, run_ranks
from planner.testing.tensor_parallel import (
    LlamaConfig,
    LlamaStack,
    parallelize_megatron,
    tensor_parallel_rank_step,
)

WORLD_SIZE = 2
FRACTIONS = (0.0, 0.5)
"""The budgets: the lowest achievable peak, and half way from it to the unplanned peak."""
TOLERANCE = 0.02
"""Measured peak against predicted, relative (issue 37's bar)."""


def test_tensor_parallel_plans_fit_every_rank_and_keep_the_gradients() -> None:
    results = run_ranks(tensor_parallel_rank_step, WORLD_SIZE, WORLD_SIZE, FRACTIONS)
    for rank, result in enumerate(results):
        assert result["capture"] == "fx", f"rank {rank} captured by {result['capture']}"
        # Each rank holds its shards: counted at their global size (before NOTE [wrapper subclasses]) a
        # rank measured more than the whole model unsplit in one process.
        assert result["parameter_bytes"] == result["shard_bytes"], f"rank {rank}: {result}"
        assert result["unplanned_bytes"] < 0.7 * result["unsplit_bytes"], f"rank {rank}: {result}"
        # checkpoint_wrapper on every block is a point of the plan space (NOTE [replayable hooks]).
        assert result["lowest_bytes"] <= result["every_block_bytes"], f"rank {rank}: {result}"
        assert result["too_low"] == f"InfeasibleBudget {result['lowest_bytes']}", f"rank {rank}: {result}"
        for row in result["plans"]:
            where = f"rank {rank}, budget {row['budget_bytes']}: {row}"
            measured, predicted = row["measured_bytes"], row["predicted_bytes"]
            assert row["regions"] > 0, f"the plan should checkpoint something; {where}"
            assert measured <= row["budget_bytes"], f"measured over the budget; {where}"
            assert abs(measured - predicted) <= TOLERANCE * predicted, where
            assert row["loss_and_gradients_equal"], f"loss or gradients differ; {where}"
            assert measured < result["unplanned_bytes"], f"checkpointing saved nothing; {where}"
    for row, other in zip(results[0]["plans"], results[1]["plans"], strict=True):
        assert row["schedule"] == other["schedule"], "the ranks got different schedules"


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _small() -> tuple[LlamaStack, torch.Tensor]:
    config = LlamaConfig(layer_count=1)
    return LlamaStack(config), torch.randint(config.vocabulary_size, (2, 8))


def test_a_parallelized_model_needs_its_mesh(one_rank_mesh: DeviceMesh) -> None:
    model, tokens = _small()
    parallelize_megatron(model, one_rank_mesh)
    with pytest.raises(planner.UnsupportedModel, match="is a DTensor.*tensor_parallel="):
        planner.optimize(model, (tokens,), budget_bytes=2**40)
    with pytest.raises(ValueError, match="compile=True.*tensor_parallel"):
        planner.optimize(model, (tokens,), budget_bytes=2**40, compile=True, tensor_parallel=one_rank_mesh)


def test_an_unparallelized_model_is_refused_with_a_mesh(one_rank_mesh: DeviceMesh) -> None:
    model, tokens = _small()
    with pytest.raises(ValueError, match="no parameter.*call parallelize_module"):
        planner.optimize(model, (tokens,), budget_bytes=2**40, tensor_parallel=one_rank_mesh)


def test_sequence_parallel_is_refused(one_rank_mesh: DeviceMesh) -> None:
    model, tokens = _small()
    parallelize_megatron(model, one_rank_mesh)
    parallelize_module(model.layers[0], one_rank_mesh, {"attention_norm": SequenceParallel()})
    with pytest.raises(planner.UnsupportedModel, match="'layers.0.attention_norm'.*SequenceParallel"):
        planner.optimize(model, (tokens,), budget_bytes=2**40, tensor_parallel=one_rank_mesh)


def test_a_dtensor_output_is_refused(one_rank_mesh: DeviceMesh) -> None:
    model, tokens = _small()
    parallelize_megatron(model, one_rank_mesh)
    parallelize_module(model, one_rank_mesh, {"output": ColwiseParallel(use_local_output=False)})
    with pytest.raises(planner.UnsupportedModel, match="'output'.*use_local_output=False"):
        planner.optimize(model, (tokens,), budget_bytes=2**40, tensor_parallel=one_rank_mesh)
