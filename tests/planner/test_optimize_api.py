"""The public face: arguments, errors, the Plan's numbers and its JSON form."""

from __future__ import annotations

import math

import pytest
import torch

import planner
from planner.errors import format_bytes
from planner.testing.steps import assert_same_step, one_step
from planner.zoo import build_model


@pytest.fixture(scope="module")
def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return build_model("seed000_mlp")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ValueError, "exactly one of budget_gb"),
        ({"budget_gb": 1, "budget_bytes": 2**30}, ValueError, "exactly one of budget_gb"),
        ({"budget_gb": -1}, ValueError, "positive, got -1"),
        ({"budget_gb": math.nan}, TypeError, "finite"),
        ({"budget_gb": True}, TypeError, "finite number"),
        ({"budget_bytes": 0}, ValueError, "positive, got 0"),
        ({"budget_bytes": 1.5}, TypeError, "must be an int"),
        ({"budget_gb": 1, "optimizer": "lion"}, ValueError, "optimizer='lion'"),
        ({"budget_gb": 1, "solver": "magic"}, ValueError, "solver='magic'"),
    ],
)
def test_bad_arguments_get_clear_errors(mlp, kwargs, error, message) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    with pytest.raises(error, match=message):
        planner.optimize(model, inputs, **kwargs)


def test_bad_model_and_inputs_get_clear_errors(mlp) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    with pytest.raises(TypeError, match="torch.nn.Module"):
        planner.optimize(lambda x: x, inputs, budget_gb=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="example_inputs"):
        planner.optimize(model, {"x": inputs[0]}, budget_gb=1)
    with pytest.raises(ValueError, match="scalar tensor"):
        planner.optimize(model, inputs, budget_gb=1, loss_fn=lambda output: output)


def test_budget_gb_counts_gib_and_a_single_tensor_is_accepted(mlp) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    plan = planner.optimize(model, inputs[0], budget_gb=1)
    assert plan.budget_bytes == 2**30
    assert plan.predicted_peak_bytes == plan.baseline_peak_bytes  # plenty of room: nothing checkpointed
    assert plan.predicted_overhead == 0.0 and plan.regions == []


def test_optimizer_state_is_accounted_by_kind(mlp) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    states = {
        name: planner.optimize(model, inputs, budget_gb=1, optimizer=name).graph.static.optimizer_state_bytes
        for name in ("adam", "sgd", "sgd-momentum", None)
    }
    assert states["sgd"] == states[None] == 0
    assert states["sgd-momentum"] == parameter_bytes
    assert states["adam"] >= 2 * parameter_bytes
    instance = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = planner.optimize(model, inputs, budget_gb=1, optimizer=instance)
    assert plan.graph.optimizer == "AdamW" and plan.graph.static.optimizer_state_bytes == states["adam"]


def test_infeasible_budget_explains_what_dominates(mlp) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    with pytest.raises(planner.InfeasibleBudget) as caught:
        planner.optimize(model, inputs, budget_bytes=2**20)
    error = caught.value
    assert isinstance(error, ValueError) and error.budget_bytes == 2**20
    assert error.min_peak_bytes > 2**20
    assert "Checkpointing cannot help" in str(error) and "optimizer state" in str(error)
    assert error.breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())


def test_plan_reports_and_round_trips_through_json(mlp) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    reference = planner.optimize(model, inputs, budget_gb=1)
    budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    plan = planner.optimize(model, inputs, budget_bytes=budget)
    assert plan.regions, "a budget below the baseline needs a checkpointed region"
    assert plan.min_peak_bytes <= plan.predicted_peak_bytes <= budget < plan.baseline_peak_bytes
    assert 0 < plan.predicted_overhead < 1
    summary = plan.summary()
    figures = (plan.budget_bytes, plan.predicted_peak_bytes, plan.baseline_peak_bytes, plan.min_peak_bytes)
    for text in (*(format_bytes(size) for size in figures), "predicted", plan.regions[0].modules[0]):
        assert text in summary, f"{text!r} missing from the summary:\n{summary}"
    loaded = planner.Plan.from_json(plan.to_json())
    assert loaded.module is None
    assert loaded.schedule == plan.schedule and loaded.graph == plan.graph
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes
    assert loaded.predicted_overhead == pytest.approx(plan.predicted_overhead)


def test_custom_loss_is_planned_with_the_model(mlp) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    target = torch.zeros(inputs[0].shape[0], 256)
    plan = planner.optimize(
        model, inputs, budget_gb=1, loss_fn=lambda output: torch.nn.functional.mse_loss(output, target)
    )
    assert plan.graph.nodes[-1].name == "loss" and not plan.graph.nodes[-1].checkpointable


def test_public_functions_stay_functions_after_their_modules_load() -> None:
    import planner.one_call  # noqa: F401  (loading the submodules must not shadow the functions)
    import planner.profiler.measurement

    assert callable(planner.optimize) and callable(planner.measure) and callable(planner.pareto)
    assert planner.optimize.__module__ == "planner.one_call"


def test_replan_solves_the_same_profile_at_another_budget_and_solver(mlp) -> None:  # type: ignore[no-untyped-def]
    model, inputs = mlp
    first = planner.optimize(model, inputs, budget_gb=1, solver="dp")
    budget = (first.min_peak_bytes + first.baseline_peak_bytes) // 2
    tighter = first.replan(budget_bytes=budget, solver="ilp")
    assert tighter.graph is first.graph
    assert (
        tighter.schedule.solver == "ilp"
        and tighter.predicted_peak_bytes <= budget < first.predicted_peak_bytes
    )
    assert tighter.module is not None and tighter.schedule.checkpointed
    assert_same_step(one_step(model, inputs), one_step(tighter.module, inputs))
    with pytest.raises(planner.InfeasibleBudget):
        first.replan(budget_bytes=first.min_peak_bytes - 1)
    with pytest.raises(ValueError, match="no model to rewrite"):
        planner.Plan.from_json(first.to_json()).replan(budget_gb=1)


def test_string_options_are_their_enums() -> None:
    """cost_model, sharding, memory_counting and budget_kind take the enums of planner (which are their
    strings) as well as the strings, and plan the same either way."""
    model, inputs = build_model("seed000_mlp")
    by_string = planner.optimize(
        model, inputs, budget_bytes=2**40, cost_model="analytic", device="h100", world_size=2,
        sharding="fsdp", memory_counting="exact", budget_kind="allocated",
    )  # fmt: skip
    by_enum = planner.optimize(
        model, inputs, budget_bytes=2**40, cost_model=planner.CostModel.ANALYTIC, device="h100",
        world_size=2, sharding=planner.Sharding.FSDP, memory_counting=planner.MemoryCounting.EXACT,
        budget_kind=planner.BudgetKind.ALLOCATED,
    )  # fmt: skip
    assert by_enum.predicted_peak_bytes == by_string.predicted_peak_bytes
    assert by_enum.graph.static == by_string.graph.static
    assert by_enum.graph.memory_counting is planner.MemoryCounting.EXACT
    assert by_enum.budget_kind is planner.BudgetKind.ALLOCATED


class _UntracedForward(torch.nn.Module):
    """A model no option check may reach: running its forward fails."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the model ran before its options were checked")


@pytest.mark.parametrize(
    ("option", "value"),
    [("cost_model", "fast"), ("sharding", "zero3"), ("memory_counting", "pages")],
)
def test_an_unknown_option_is_refused_by_name_before_the_model_runs(option: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{option}='{value}' is not known; use "):
        planner.profile(_UntracedForward(), torch.randn(2, 4), **{option: value})
