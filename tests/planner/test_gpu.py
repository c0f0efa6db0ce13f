"""On a GPU, the plan must fit the allocator's own peak (`max_memory_allocated`) and predict it within 5 %.

Skipped without CUDA (CI and the development machines have none); run it where a GPU is available.
"""

from __future__ import annotations

import copy

import pytest
import torch

import planner
from planner.testing.steps import assert_same_step, one_step
from planner.zoo import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", ["gpt_tiny", "cnn_bn_dropout"])
def test_cuda_plan_fits_and_predicts_the_allocator_peak(name: str) -> None:
    model, inputs = build_model(name)
    model = model.cuda()
    inputs = tuple(t.cuda() for t in inputs)
    reference = planner.optimize(model, inputs, budget_bytes=2**40)
    budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    plan = planner.optimize(model, inputs, budget_bytes=budget)
    assert plan.module is not None
    measured = planner.measure(copy.deepcopy(plan.module), inputs)
    assert measured.device.startswith("cuda")
    assert measured.peak_bytes <= budget
    assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs), rtol=1e-5)
