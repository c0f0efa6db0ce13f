"""On a GPU, a plan must fit the allocator's own peaks: `max_memory_allocated` for an allocated budget
(the default), predicted within 2 %, and `max_memory_reserved` for a reserved budget.

Skipped without CUDA (CI and the development machines have none); `make gpu-check` runs it where a GPU
is lent.
"""

from __future__ import annotations

import gc

import pytest
import torch

import planner
from planner.testing.steps import assert_same_step, one_step
from planner.testing.zoo_real import build_call
from planner.zoo import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODELS = ["gpt_tiny", "cnn_bn_dropout"]


def _on_cuda(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, inputs = build_model(name)
    return model.cuda(), tuple(
        tensor.detach().cuda().requires_grad_(tensor.requires_grad) for tensor in inputs
    )


def _measure(plan: planner.Plan, inputs: tuple[torch.Tensor, ...]) -> planner.MeasuredStep:
    """Two steps of `plan.module` itself, with the allocator's cache emptied: a copy would leave the
    model's parameters, which plan.module shares, beside it in the reserved segments."""
    assert plan.module is not None
    gc.collect()
    torch.cuda.empty_cache()
    return planner.measure(plan.module, inputs)


@pytest.mark.parametrize("name", MODELS)
def test_cuda_plan_fits_and_predicts_the_allocated_peak(name: str) -> None:
    model, inputs = _on_cuda(name)
    reference = planner.optimize(model, inputs, budget_bytes=2**40, budget_kind="allocated")
    budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    plan = planner.optimize(model, inputs, budget_bytes=budget, budget_kind="allocated")
    assert plan.module is not None
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs), rtol=1e-5)
    measured = _measure(plan, inputs)
    assert measured.device.startswith("cuda")
    assert measured.peak_bytes <= budget
    assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes


@pytest.mark.xfail(
    strict=True,
    reason=(
        "the reserved model is not yet calibrated: on an H100 (2026-11-27) cnn_bn_dropout's plan at a "
        "50.3 MB reserved budget measured 125.8 MB reserved, 69.2 MB of it the cuBLAS workspaces and "
        "other tensors' segments; see docs/memory.md, 'On a GPU'"
    ),
)
@pytest.mark.parametrize("name", MODELS)
def test_cuda_plan_fits_a_reserved_budget(name: str) -> None:
    model, inputs = _on_cuda(name)
    reference = planner.optimize(model, inputs, budget_bytes=2**40, budget_kind="reserved")
    budget = (reference.min_peak_bytes + reference.reserved.reserved_peak_bytes) // 2
    plan = planner.optimize(model, inputs, budget_bytes=budget, budget_kind="reserved")
    measured = _measure(plan, inputs)
    assert measured.reserved_peak_bytes is not None
    assert measured.reserved_peak_bytes <= budget


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert", "hf_llama", "hf_t5", "hf_vit"])
def test_cuda_plan_of_a_hugging_face_model_trains_as_the_model(name: str) -> None:
    """On a GPU the kernels, and their dropout draws, follow how each operator is called: the captured
    module must call them as the model does (NOTE [grouped heads]; zoo_real's Llama trained with another
    loss on an H100 before)."""
    call = build_call(name)
    model = call.model.cuda()
    args = tuple(value.cuda() for value in call.args)
    kwargs = {key: value.cuda() for key, value in call.kwargs.items()}
    reference = planner.optimize(model, args, example_kwargs=kwargs, budget_bytes=2**40)
    budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    plan = planner.optimize(model, args, example_kwargs=kwargs, budget_bytes=budget)
    assert plan.module is not None
    assert_same_step(
        one_step(model, args, kwargs=kwargs), one_step(plan.module, args, kwargs=kwargs), rtol=1e-5
    )
