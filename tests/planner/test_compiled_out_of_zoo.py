"""Compiled plans of models the planner was not built around (planner/testing/compiled_models.py), small.

With and without `torch._inductor.config.fallback_random`: no checkpointing and half of the predicted
range are predicted within 2 % of the compiled step's measured peak and fit their budgets, the plan at
half the range trains as `torch.compile` without checkpointing does (same seed, dropout active), and
the lowest peak we predict is not above what `torch.compile` itself measures, so a budget that
`torch.compile` fits is never refused as impossible. Before NOTE [hoisted operators] the ViT measured
4 % above its prediction; before the fix to `random_draws`, GPT-2 under `fallback_random` was
predicted 27 % above its measured step at every budget, the lowest included. diffusers' UNet2DModel,
planned at the peak `torch.compile`'s own recompute measures, is checked on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import planner
from planner.compiled.optimize import plan_compiled_step
from planner.ir import TrainingStep
from planner.profiler.measurement import default_loss
from planner.testing.compiled_models import COMPILED_CHECK_MODELS
from planner.testing.hand_methods import hand_methods
from planner.testing.steps import seeded_gradients
from planner.testing.zoo_real import ExampleCall, build_call
from tests.planner.compiled_steps import GRADIENT_RTOL, HUGE_BUDGET_BYTES, SEED

REPOSITORY = Path(__file__).resolve().parents[2]
PREDICTION_TOLERANCE = 0.02
SIZES: dict[str, dict[str, int]] = {
    "encoder_vit": {"width": 64, "layers": 2, "batch": 4},
    "gpt2_dropout": {"layers": 2, "width": 64, "sequence": 64, "batch": 2},
    "conv_dropout2d": {"channels": 16, "blocks": 3, "batch": 8},
}
CASES = [("encoder_vit", False), ("encoder_vit", True), ("gpt2_dropout", True), ("conv_dropout2d", True)]


def _call(model: str) -> ExampleCall:
    return COMPILED_CHECK_MODELS[model](**SIZES[model])


def _gradients(module: torch.nn.Module, call: ExampleCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and flattened gradients of one step of `module` (which computes `call.model`) under `SEED`."""
    return seeded_gradients(module, list(call.model.parameters()), call.args, call.kwargs, seed=SEED)


def _measured_peak_bytes(module: torch.nn.Module, call: ExampleCall) -> int:
    return planner.measure(module, call.args, example_kwargs=call.kwargs).peak_bytes


def _assert_trains_as(
    module: torch.nn.Module, call: ExampleCall, loss: torch.Tensor, gradients: torch.Tensor, label: str
) -> None:
    """One seeded step of `module` gives `loss` and `gradients` (a reference's) within `GRADIENT_RTOL`."""
    actual_loss, actual_gradients = _gradients(module, call)
    torch.testing.assert_close(actual_loss, loss, rtol=GRADIENT_RTOL, atol=0.0)
    error = ((actual_gradients - gradients).norm() / gradients.norm()).item()
    assert error <= GRADIENT_RTOL, f"{label}: gradients differ by {error:.1e}"


def _assert_fits_as_predicted(plan: planner.Plan, call: ExampleCall, budget: int, label: str) -> None:
    """`plan.module` measures within `budget`, and within `PREDICTION_TOLERANCE` of its prediction."""
    assert plan.module is not None
    measured = _measured_peak_bytes(plan.module, call)
    assert measured <= budget, f"{label}: measured {measured} over {budget}\n{plan.summary()}"
    deviation = (plan.predicted_peak_bytes - measured) / measured
    assert abs(deviation) <= PREDICTION_TOLERANCE, (
        f"{label}: predicted {plan.predicted_peak_bytes}, measured {measured} ({deviation:+.2%})\n"
        f"{plan.summary()}"
    )


@pytest.mark.parametrize(("model", "fallback_random"), CASES)
def test_compiled_predictions_hold_on_a_model_not_built_for_them(model: str, fallback_random: bool) -> None:
    with torch._inductor.config.patch(fallback_random=fallback_random):
        call = _call(model)
        reference = plan_compiled_step(
            call.model, call.args, call.kwargs, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam",
            step=TrainingStep(), loss_fn=default_loss, solver="auto", device=None,
        )  # fmt: skip
        lowest, baseline = reference.min_peak_bytes, reference.baseline_peak_bytes
        plain = torch.compile(call.model)
        expected_loss, expected_gradients = _gradients(plain, call)
        plain_peak_bytes = _measured_peak_bytes(plain, call)
        assert lowest <= plain_peak_bytes, (
            f"{model}: predicted lowest peak {lowest} above torch.compile's measured {plain_peak_bytes}: "
            "a budget torch.compile fits would be refused as impossible"
        )
        for fraction in (1.0, 0.5):
            budget = int(lowest + fraction * (baseline - lowest))
            planned = _call(model)
            plan = planner.optimize(
                planned.model, planned.args, example_kwargs=planned.kwargs, budget_bytes=budget, compile=True
            )
            assert plan.module is not None
            label = f"{model} (fallback_random={fallback_random}) at {fraction}"
            if fraction < 1.0:
                _assert_trains_as(plan.module, planned, expected_loss, expected_gradients, label)
            _assert_fits_as_predicted(plan, planned, budget, label)


def test_a_budget_torch_compiles_own_recompute_fits_is_not_refused() -> None:
    """NOTE [order after fusion] in planner/compiled/backward_order.py: at the peak `torch.compile` with
    `activation_memory_budget=0.5` measures on diffusers' UNet2DModel (5.26 MiB), with gradients equal
    to its, our plans measured 219 KiB over their prediction and that budget was refused as impossible.
    Now our plan fits it when measured, as predicted, at its first compilation, and trains the same."""
    from bench.compare_measurement import budget_backend

    call = build_call("diffusers_unet")
    peer = torch.compile(call.model, backend=budget_backend(0.5))
    expected_loss, expected_gradients = _gradients(peer, call)
    budget = _measured_peak_bytes(peer, call)
    planned = build_call("diffusers_unet")
    plan = planner.optimize(planned.model, planned.args, budget_bytes=budget, compile=True)
    assert plan.module is not None and plan.compiled is not None
    assert plan.compiled.attempts == 1, plan.summary()
    _assert_trains_as(plan.module, planned, expected_loss, expected_gradients, "diffusers_unet")
    _assert_fits_as_predicted(plan, planned, budget, "diffusers_unet")


HAND_METHOD_OF = {
    "encoder_vit": "every MultiheadAttention",
    "gpt2_dropout": "every GPT2Block",
    "conv_dropout2d": "every Conv2d",
}
"""Per model, the hand method whose compiled step measured lowest of all that apply (one-off run,
2026-11-27: the ViT's five measured 4.55 to 5.30 MiB, GPT-2's seven 4.17 to 5.01 MiB, the CNN's three
2.34 to 3.34 MiB)."""


@pytest.mark.parametrize("model", sorted(HAND_METHOD_OF))
def test_no_compiled_hand_method_measures_below_our_lowest_compiled_peak(model: str) -> None:
    """Issue 35's rule for `compile=True`: a budget below our lowest predicted compiled peak is refused as
    impossible, so the lowest hand method, `checkpoint_wrapper` on every instance of a type and then
    `torch.compile` as a user writes it, must measure at or above it (the CNN's every Conv2d measures
    exactly our lowest). Each measured in a fresh process, as a user's first compilation is."""
    script = f"from {__name__} import lowest_against_hand; lowest_against_hand({model!r})"
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPOSITORY)
    assert ran.returncode == 0, ran.stderr[-3000:]
    outcome = json.loads(ran.stdout.strip().splitlines()[-1])
    assert outcome["lowest_bytes"] <= outcome["hand_bytes"], outcome


def lowest_against_hand(model: str) -> None:
    """The body of the test above, for a fresh process: prints our lowest predicted compiled peak and the
    hand method's measured one as a line of JSON."""
    call = _call(model)
    (method,) = [
        found
        for found in hand_methods(call.model, call.args, kwargs=call.kwargs)
        if found.name == HAND_METHOD_OF[model]
    ]
    assert method.variant is not None, method.description
    hand_bytes = _measured_peak_bytes(torch.compile(method.variant.module), call)
    reference = plan_compiled_step(
        call.model, call.args, call.kwargs, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam",
        step=TrainingStep(), loss_fn=default_loss, solver="auto", device=None,
    )  # fmt: skip
    print(json.dumps({"lowest_bytes": reference.min_peak_bytes, "hand_bytes": hand_bytes}))
