"""The spine's promise on every zoo model: fits, predicts within 2 %, same gradients, never worse.

Budgets are `min + f * (baseline - min)` for f in 0, 0.1, 0.5, 0.9, where min and baseline are the plan's
own predicted lowest and no-checkpointing peaks. Measured peaks come from two real training steps
with Adam under the live-storage tracker.
"""

from __future__ import annotations

import copy
from functools import cache

import pytest

import planner
from planner.testing.steps import assert_same_step, one_step
from planner.zoo import FIDELITY_ZOO, build_model

FRACTIONS = (0.0, 0.1, 0.5, 0.9)
PREDICTION_TOLERANCE = 0.02


@cache
def reference(name: str) -> tuple[int, int, int]:
    """(lowest predicted peak, predicted baseline, measured baseline) of a zoo model."""
    model, inputs = build_model(name)
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    measured = planner.measure(copy.deepcopy(model), inputs).peak_bytes
    return plan.min_peak_bytes, plan.baseline_peak_bytes, measured


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", FIDELITY_ZOO)
def test_plan_fits_predicts_and_keeps_gradients(name: str, fraction: float) -> None:
    lowest, baseline, measured_baseline = reference(name)
    budget = int(lowest + fraction * (baseline - lowest))
    model, inputs = build_model(name)
    plan = planner.optimize(model, inputs, budget_bytes=budget)

    measured = planner.measure(copy.deepcopy(plan.module), inputs).peak_bytes
    assert measured <= budget, f"{name}: measured {measured} over budget {budget}\n{plan.summary()}"
    error = abs(plan.predicted_peak_bytes - measured) / measured
    assert error <= PREDICTION_TOLERANCE, (
        f"{name}: predicted {plan.predicted_peak_bytes}, measured {measured}"
    )
    assert measured <= measured_baseline, (
        f"{name}: the plan measured {measured}, more than no plan {measured_baseline}"
    )
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs))


@pytest.mark.parametrize("name", ["seed000_mlp", "gpt_tiny"])
def test_exactly_the_lowest_peak_fits_and_one_byte_less_does_not(name: str) -> None:
    lowest, _, _ = reference(name)
    model, inputs = build_model(name)
    plan = planner.optimize(model, inputs, budget_bytes=lowest)
    assert plan.predicted_peak_bytes <= lowest
    assert planner.measure(copy.deepcopy(plan.module), inputs).peak_bytes <= lowest
    with pytest.raises(planner.InfeasibleBudget) as caught:
        planner.optimize(model, inputs, budget_bytes=lowest - 1)
    assert caught.value.min_peak_bytes == lowest


def test_baseline_prediction_matches_measurement() -> None:
    for name in ("seed000_mlp", "cnn_bn_dropout"):
        _, baseline, measured_baseline = reference(name)
        assert abs(baseline - measured_baseline) <= PREDICTION_TOLERANCE * measured_baseline
