"""bench/out_of_zoo.py's models and verdicts: the sweep itself runs for minutes and asserts nothing, so
these check that every model of planner/testing/zoo_unseen.py builds and trains one step, and that the
table's verdict names each thing a user would hold against a plan."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from bench.out_of_zoo import LOWEST, markdown, verdict
from planner.profiler.measurement import default_loss
from planner.testing.zoo_unseen import UNSEEN_ZOO


@pytest.mark.parametrize("name", list(UNSEEN_ZOO))
def test_every_unseen_model_builds_in_train_mode_and_its_call_gives_a_loss(name: str) -> None:
    call = UNSEEN_ZOO[name][1]()
    assert call.model.training
    loss = default_loss(call.model(*call.args, **call.kwargs))
    assert loss.requires_grad and loss.dim() == 0


def _result(**changes: Any) -> dict[str, Any]:
    plans = [
        {"at": "own switch", "budget_bytes": 100, "predicted_bytes": 90, "measured_bytes": 90, "fits": True,
         "gradient_error": 0.0},
        {"at": LOWEST, "budget_bytes": 80, "predicted_bytes": 80, "measured_bytes": 80, "fits": True,
         "gradient_error": 0.0},
    ]  # fmt: skip
    result = {
        "model": "m", "description": "", "model_bytes": 120, "capture": "export", "module_bytes": 120,
        "lowest_predicted_bytes": 80, "hand_methods": {"own switch": 100}, "plans": plans, "seconds": 1.0,
    }  # fmt: skip
    return result | changes


def test_the_verdict_is_ok_only_when_nothing_is_held_against_the_plan() -> None:
    assert verdict(_result()) == "ok"
    assert "costs more than the model" in verdict(_result(module_bytes=121))
    assert "beats our lowest" in verdict(_result(hand_methods={"own switch": 79}))
    over = copy.deepcopy(_result())
    over["plans"][0] |= {"measured_bytes": 101, "fits": False}
    assert "does not fit" in verdict(over)
    differing = copy.deepcopy(_result())
    differing["plans"][1]["gradient_error"] = 1e-3
    assert "gradients differ" in verdict(differing)
    assert verdict(differing | {"model_step_error": 0.1}) == (
        "the model's own steps differ under one seed (gradients not compared)"
    )
    refused = copy.deepcopy(_result(hand_methods={"own switch": 79}))
    refused["plans"][0] = {"at": "own switch", "budget_bytes": 79, "error": "InfeasibleBudget: ..."}
    assert verdict(refused) == "a hand method beats our lowest", "a refusal below our lowest is no misfit"


def test_a_refusal_shows_its_last_reason_without_module_lists_and_a_crash_its_error() -> None:
    refused = {
        "model": "r", "description": "", "model_bytes": 1, "seconds": 0.1,
        "error": "UnsupportedModel: fx failed; and at the module level it calls ['a', 'b'] at random",
    }  # fmt: skip
    assert verdict(refused) == "refused: at the module level it calls [...] at random"
    crashed = refused | {"error": "AssertionError: Expected gradient function to be set"}
    assert verdict(crashed) == "crashed: AssertionError: Expected gradient function to be set"
    table = markdown(
        [_result(), refused],
        {"revision": {"commit": "abc"}, "machine": {"torch_version": "t", "cpu_count": 2}},
    )
    assert "| m | export |" in table and "refused: at the module level" in table
