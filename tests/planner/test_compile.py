"""`torch.compile(plan.module)` trains with the original's gradients on the CPU (inductor).

Under torch.compile the checkpointed regions become checkpoint higher-order ops whose replay
AOTAutograd plans (see NOTE [torch.compile] in planner/rewrite.py). Compiling takes tens of seconds
on a small CPU, so one small model is compiled: the in-place MLP, captured by torch.export, whose plan
has a checkpointed region. Inductor fuses and reorders floating-point work, hence a tolerance.
"""

from __future__ import annotations

import copy

import torch
from test_real_models import mid_budget_plan, one_call_step
from zoo_checks import assert_same_step

COMPILED_TOLERANCE = 1e-4


def test_compiled_plan_trains_with_the_original_gradients() -> None:
    planned = mid_budget_plan("inplace_mlp")
    assert planned.plan.regions, "the plan should checkpoint something for the test to mean anything"
    assert planned.plan.module is not None
    compiled = torch.compile(copy.deepcopy(planned.plan.module))
    expected = one_call_step(planned.call.model, planned.call)
    actual = one_call_step(compiled, planned.call)
    actual.gradients = {name.removeprefix("_orig_mod."): g for name, g in actual.gradients.items()}
    actual.buffers = {name.removeprefix("_orig_mod."): b for name, b in actual.buffers.items()}
    assert_same_step(expected, actual, rtol=COMPILED_TOLERANCE)
