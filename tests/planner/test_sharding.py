"""Per-rank accounting of data parallelism: `optimize(..., world_size=N, sharding="ddp" | "fsdp")`.

These check the accounting's rules on one process; tests/planner/test_rank_memory.py checks its
predictions against what each rank of real DDP and FSDP2 steps measures.
"""

from __future__ import annotations

import pytest
import torch

import planner
from planner.planning.fsdp_units import fsdp_units
from planner.testing.zoo_real import build_call
from planner.zoo import build_model

WORLD_SIZE = 4


@pytest.fixture(scope="module")
def plans() -> dict[str, planner.Plan]:
    model, inputs = build_model("seed000_mlp")
    return {
        "single": planner.optimize(model, inputs, budget_bytes=2**40),
        "ddp": planner.optimize(model, inputs, budget_bytes=2**40, world_size=WORLD_SIZE, sharding="ddp"),
        "fsdp": planner.optimize(model, inputs, budget_bytes=2**40, world_size=WORLD_SIZE, sharding="fsdp"),
        "fsdp_kept": planner.optimize(
            model,
            inputs,
            budget_bytes=2**40,
            world_size=WORLD_SIZE,
            sharding="fsdp",
            reshard_after_forward=False,
        ),
        "fsdp_one_rank": planner.optimize(model, inputs, budget_bytes=2**40, sharding="fsdp"),
    }


def test_ddp_replicates_state_and_adds_its_gradient_buckets(plans: dict[str, planner.Plan]) -> None:
    single, ddp = plans["single"].graph.static, plans["ddp"].graph.static
    assert ddp.parameter_bytes == single.parameter_bytes
    assert ddp.optimizer_state_bytes == single.optimizer_state_bytes
    assert ddp.buffer_bytes == single.buffer_bytes + single.gradient_bytes
    assert plans["ddp"].baseline_peak_bytes > plans["single"].baseline_peak_bytes


def test_fsdp_splits_state_across_ranks_and_gathers_units(plans: dict[str, planner.Plan]) -> None:
    single, fsdp = plans["fsdp_one_rank"].graph, plans["fsdp"].graph
    assert plans["fsdp"].capture == "module (fsdp units)", "FSDP plans keep submodules as module calls"
    model, _ = build_model("seed000_mlp")
    units = fsdp_units(model, world_size=WORLD_SIZE)
    assert units.unsharded_bytes == single.static.parameter_bytes
    assert fsdp.static.parameter_bytes == sum(unit.shard_bytes for unit in units.units)
    assert fsdp.static.gradient_bytes == sum(unit.reduced_bytes for unit in units.units), "one per unit"
    adam_step_bytes = single.static.optimizer_state_bytes - 2 * single.static.parameter_bytes
    assert adam_step_bytes == 512 * len(list(model.parameters())), "a scalar step per parameter"
    assert fsdp.static.optimizer_state_bytes == (
        2 * sum(unit.local_shard_bytes for unit in units.units) + adam_step_bytes
    ), "Adam's moments are sharded, its steps are not"
    assert fsdp.static.parameter_bytes < single.static.parameter_bytes // 2
    for sharded, whole in zip(fsdp.nodes, single.nodes, strict=True):
        index = units.block_index(whole)
        if index is not None:  # NOTE [FSDP2 per rank]: its parameters and its all-gather buffer
            block = units.blocks[index]
            assert sharded.forward_workspace_bytes == (
                whole.forward_workspace_bytes + block.parameter_bytes + block.gathered_bytes
            ), whole.name
        assert sharded.backward_workspace_bytes >= whole.backward_workspace_bytes, whole.name
    assert plans["fsdp"].baseline_peak_bytes < plans["ddp"].baseline_peak_bytes


def test_without_resharding_every_block_run_keeps_its_parameters(plans: dict[str, planner.Plan]) -> None:
    resharded, kept = plans["fsdp"].graph.nodes, plans["fsdp_kept"].graph.nodes
    model, _ = build_model("seed000_mlp")
    units = fsdp_units(model, world_size=WORLD_SIZE)
    last = max(position for position, node in enumerate(resharded) if units.block_index(node) is not None)
    earlier_bytes = sum(block.parameter_bytes for block in units.blocks[:-1])
    assert earlier_bytes > 0
    assert kept[last].forward_workspace_bytes == resharded[last].forward_workspace_bytes + earlier_bytes
    assert plans["fsdp_kept"].baseline_peak_bytes > plans["fsdp"].baseline_peak_bytes


def test_fsdp_units_are_the_blocks_and_what_lies_outside_them() -> None:
    call = build_call("tied_lm")
    units = fsdp_units(call.model, world_size=WORLD_SIZE)
    assert [block.module_path for block in units.blocks] == [
        f"blocks.{n}" for n in range(len(call.model.blocks))
    ]
    block_bytes = sum(p.numel() * 4 for p in call.model.blocks[0].parameters())
    outside_bytes = sum(
        p.numel() * 4 for p in (*call.model.embedding.parameters(), *call.model.norm.parameters())
    )
    assert units.blocks[0].parameter_bytes >= block_bytes
    assert units.root.parameter_bytes >= outside_bytes, "the tied head is the embedding's weight, once"
    assert units.root.parameter_bytes < outside_bytes + 512 * 3


def test_an_uneven_split_pads_every_shard() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 5, bias=False), torch.nn.Linear(5, 5, bias=False))
    units = fsdp_units(model, world_size=WORLD_SIZE, counting=planner.MemoryCounting.EXACT)
    assert [block.parameter_bytes for block in units.blocks] == [5 * 8 * 4, 5 * 5 * 4]
    assert [block.gathered_bytes for block in units.blocks] == [8 * 8 * 4, 8 * 5 * 4], (
        "5 rows -> 4 shards of 2"
    )
    assert [block.shard_bytes for block in units.blocks] == [2 * 8 * 4, 2 * 5 * 4]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world_size": 0}, ValueError, "world_size must be a positive int"),
        ({"world_size": 2, "sharding": "zero3"}, ValueError, "zero3"),
        ({"world_size": 2, "reshard_after_forward": False}, ValueError, "sharding='ddp'"),
        ({"world_size": 2, "sharding": "fsdp", "reshard_after_forward": "no"}, TypeError, "'no'"),
    ],
)
def test_bad_sharding_arguments_name_the_value(kwargs: dict[str, object], error: type, message: str) -> None:
    model, inputs = build_model("seed000_mlp")
    with pytest.raises(error, match=message):
        planner.optimize(model, inputs, budget_bytes=2**40, **kwargs)  # type: ignore[arg-type]
