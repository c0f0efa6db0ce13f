"""Per-rank accounting of data parallelism: `optimize(..., world_size=N, sharding="ddp" | "fsdp")`."""

from __future__ import annotations

import pytest

import planner
from planner.planning.model import fsdp_unit_bytes
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
        "fsdp_one_rank": planner.optimize(model, inputs, budget_bytes=2**40, sharding="fsdp"),
    }


def test_ddp_replicates_state_and_adds_its_gradient_buckets(plans: dict[str, planner.Plan]) -> None:
    single, ddp = plans["single"].graph.static, plans["ddp"].graph.static
    assert ddp.parameter_bytes == single.parameter_bytes
    assert ddp.optimizer_state_bytes == single.optimizer_state_bytes
    assert ddp.buffer_bytes == single.buffer_bytes + single.gradient_bytes
    assert plans["ddp"].baseline_peak_bytes > plans["single"].baseline_peak_bytes


def test_fsdp_splits_state_across_ranks_and_gathers_one_unit(plans: dict[str, planner.Plan]) -> None:
    single, fsdp = plans["fsdp_one_rank"].graph, plans["fsdp"].graph
    assert plans["fsdp"].capture == "module (fsdp units)", "FSDP plans keep submodules as module calls"
    assert fsdp.static.parameter_bytes == -(-single.static.parameter_bytes // WORLD_SIZE)
    assert fsdp.static.gradient_bytes == -(-single.static.gradient_bytes // WORLD_SIZE)
    assert fsdp.static.optimizer_state_bytes == -(-single.static.optimizer_state_bytes // WORLD_SIZE)
    model, _ = build_model("seed000_mlp")
    unit = fsdp_unit_bytes(model)
    assert all(
        sharded.forward_workspace_bytes == whole.forward_workspace_bytes + unit
        for sharded, whole in zip(fsdp.nodes, single.nodes, strict=True)
    )
    assert plans["fsdp"].baseline_peak_bytes < plans["ddp"].baseline_peak_bytes


def test_fsdp_unit_is_the_largest_block_or_what_lies_outside_the_blocks() -> None:
    call = build_call("tied_lm")
    model = call.model
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    outside_bytes = sum(p.numel() * 4 for p in (*model.embedding.parameters(), *model.norm.parameters()))
    assert fsdp_unit_bytes(model) == max(block_bytes, outside_bytes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"world_size": 2, "sharding": "zero3"}, "zero3"),
    ],
)
def test_bad_sharding_arguments_name_the_value(kwargs: dict[str, object], message: str) -> None:
    model, inputs = build_model("seed000_mlp")
    with pytest.raises(ValueError, match=message):
        planner.optimize(model, inputs, budget_bytes=2**40, **kwargs)  # type: ignore[arg-type]
