"""`torch.compile(plan.module)` trains with the original's gradients on the CPU (inductor).

Under torch.compile the checkpointed regions become checkpoint higher-order ops whose replay
AOTAutograd plans (see NOTE [torch.compile] in planner/rewrite/emit.py). Compiling takes tens of seconds
on a small CPU, so one small model is compiled: the in-place MLP, captured by torch.export, whose plan
has a checkpointed region. Inductor fuses and reorders floating-point work, hence a tolerance.
"""

from __future__ import annotations

import copy

import torch

from planner.testing.steps import Variant, assert_same_step, one_step
from tests.planner.real_models import MidBudgetPlanner

COMPILED_TOLERANCE = 1e-4


def test_compiled_plan_trains_with_the_original_gradients(mid_budget_plan: MidBudgetPlanner) -> None:
    planned = mid_budget_plan("inplace_mlp")
    assert planned.plan.regions, "the plan should checkpoint something for the test to mean anything"
    assert planned.plan.module is not None
    module = copy.deepcopy(planned.plan.module)
    compiled = Variant(torch.compile(module), dict(module.named_parameters()), dict(module.named_buffers()))
    call = planned.call
    expected = one_step(call.model, call.args, kwargs=call.kwargs)
    actual = one_step(compiled, call.args, kwargs=call.kwargs)
    assert_same_step(expected, actual, rtol=COMPILED_TOLERANCE)
