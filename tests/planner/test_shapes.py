"""plan.module trains at every shape the original trains at: the budget holds below the example's
shapes, the prediction at a shape matches its measurement, and a larger shape warns once.

One plan per zoo family (a Hugging Face model captured by torch.export with dynamic dimensions, an FX
CNN, keyword inputs, an FX graph with an inlined exported container, a model planned by submodules),
each profiled once, at the mid budget.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from torch import nn

import planner
from planner.capture.records import Capture, GraphCall
from planner.errors import LargerShapeWarning, format_bytes
from planner.rewrite.emit import CheckpointedRegion
from planner.rewrite.other_shapes import MANY_SHAPES, is_larger
from planner.testing.steps import assert_same_step, one_step
from planner.testing.zoo_real import ExampleCall, build_call
from tests.planner.real_models import entries

PREDICTION_TOLERANCE = 0.02


@dataclass(frozen=True)
class Planned:
    call: ExampleCall
    plan: planner.Plan


@cache
def planned(name: str) -> Planned:
    call = build_call(name)
    profile = planner.profile(call.model, call.args, example_kwargs=call.kwargs)
    frontier = profile.pareto(points=2, solver="dp")
    budget = (frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2
    return Planned(call=call, plan=profile.plan(budget_bytes=budget, solver="dp"))


def _shrunk(value: object, dims: tuple[int, ...]) -> object:
    if not isinstance(value, torch.Tensor):
        return value
    index = tuple(slice(0, max(1, n // 2)) if d in dims else slice(None) for d, n in enumerate(value.shape))
    return value[index].contiguous()


def halved(call: ExampleCall, dims: tuple[int, ...]) -> ExampleCall:
    """The example call with the tensors' `dims` halved (batch: (0,), sequence: (1,))."""
    return ExampleCall(
        call.model,
        tuple(_shrunk(value, dims) for value in call.args),
        {key: _shrunk(value, dims) for key, value in call.kwargs.items()},
    )


HALF_BATCH, HALF_SEQUENCE = (0,), (1,)
SMALLER: list[tuple[str, tuple[int, ...]]] = [
    ("hf_gpt2", HALF_BATCH),
    ("hf_gpt2", HALF_SEQUENCE),
    ("keyword_dataclass", HALF_BATCH),
    ("keyword_dataclass", HALF_SEQUENCE),
    ("resnet", HALF_BATCH),
    ("vit_torch_encoder", HALF_BATCH),
    ("branching_root", HALF_BATCH),
]
"""Every zoo family at half its batch and, where it has one, half its sequence."""


@pytest.mark.parametrize(
    ("name", "dims"), [pytest.param(name, dims, marks=entries([name])[0].marks) for name, dims in SMALLER]
)
def test_smaller_calls_fit_the_budget_and_keep_gradients(name: str, dims: tuple[int, ...]) -> None:
    done = planned(name)
    smaller = halved(done.call, dims)
    module = done.plan.module
    assert module is not None
    measured = planner.measure(copy.deepcopy(module), smaller.args, example_kwargs=smaller.kwargs).peak_bytes
    assert measured <= done.plan.budget_bytes, f"{name} at {dims} halved: {measured} over the budget"
    assert_same_step(
        one_step(smaller.model, smaller.args, kwargs=smaller.kwargs),
        one_step(module, smaller.args, kwargs=smaller.kwargs),
    )
    if done.plan.capture.startswith("module"):
        with pytest.raises(planner.UnsupportedModel, match="meta device"):
            done.plan.predicted_peak_bytes_for(*smaller.args, **smaller.kwargs)
        return
    predicted = done.plan.predicted_peak_bytes_for(*smaller.args, **smaller.kwargs)
    assert abs(predicted - measured) <= PREDICTION_TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("name", entries(["hf_gpt2", "vit_torch_encoder"]))
def test_a_batch_of_one_trains_with_the_original_gradients(name: str) -> None:
    done = planned(name)
    kwargs = done.call.kwargs
    one = ExampleCall(
        done.call.model,
        tuple(value[:1] for value in done.call.args),
        {key: value[:1] if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()},
    )
    assert done.plan.module is not None
    assert_same_step(
        one_step(one.model, one.args, kwargs=one.kwargs),
        one_step(done.plan.module, one.args, kwargs=one.kwargs),
    )


@pytest.mark.parametrize("name", entries(["hf_gpt2"]))
def test_an_exported_model_runs_other_shapes_on_its_one_dynamic_graph(name: str) -> None:
    done = planned(name)
    module = copy.deepcopy(done.plan.module)
    assert done.plan.capture == "export"
    for dims in (HALF_BATCH, HALF_SEQUENCE, (0, 1)):
        smaller = halved(done.call, dims)
        module(*smaller.args, **smaller.kwargs)
    dispatch = module._planner_calls
    assert len(dispatch.entries) == 1 and dispatch.entries[0][0].exported_shapes is not None


def test_the_example_is_predicted_as_planned_on_the_meta_device() -> None:
    done = planned("keyword_dataclass")
    call = done.call
    assert done.plan.predicted_peak_bytes_for(*call.args, **call.kwargs) == done.plan.predicted_peak_bytes


def test_a_larger_call_warns_once_with_its_predicted_peak() -> None:
    done = planned("keyword_dataclass")
    call = done.call
    larger = ExampleCall(
        call.model,
        (torch.cat([call.args[0], call.args[0]]),),
        {**call.kwargs, "attention_mask": torch.cat([call.kwargs["attention_mask"]] * 2)},
    )
    predicted = done.plan.predicted_peak_bytes_for(*larger.args, **larger.kwargs)
    assert predicted > done.plan.budget_bytes
    module = copy.deepcopy(done.plan.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module(*call.args, **call.kwargs)
        module(*larger.args, **larger.kwargs)
        module(*larger.args, **larger.kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, LargerShapeWarning)]
    assert len(messages) == 1, messages
    assert format_bytes(predicted) in messages[0] and "largest batch" in messages[0]
    measured = planner.measure(copy.deepcopy(module), larger.args, example_kwargs=larger.kwargs).peak_bytes
    assert abs(predicted - measured) <= PREDICTION_TOLERANCE * measured, (predicted, measured)


def test_calls_are_larger_when_a_dimension_is() -> None:
    assert is_larger([(8, 64), None], [(8, 65), None]) and not is_larger([(8, 64)], [(4, 64)])
    assert is_larger([(8, 64)], [(4, 64), (4, 64), (4, 64)]) and not is_larger([(8, 64)], [(2, 64), (2, 64)])


class SizeBranching(nn.Module):
    """Doubles its input when the batch holds more than four rows: a branch on a size, which FX cannot
    trace (so torch.export captures it) and export guards (so a smaller batch needs another graph)."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            x = 2 * x
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_shape_the_graph_excludes_is_captured_again_once_with_the_plans_regions() -> None:
    torch.manual_seed(0)
    model, example = SizeBranching(), torch.randn(64, 32)
    profile = planner.profile(model, (example,))
    frontier = profile.pareto(points=2, solver="dp")
    budget = (frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2
    plan = profile.plan(budget_bytes=budget, solver="dp")
    assert plan.capture == "export" and plan.module is not None and plan.regions
    module = copy.deepcopy(plan.module)
    small = ExampleCall(model, (example[:3],))
    assert_same_step(
        one_step(model, small.args, kwargs=small.kwargs), one_step(module, small.args, kwargs=small.kwargs)
    )
    for rows in (3, 2, 3):
        module(example[:rows])
    dispatch = module._planner_calls
    assert len(dispatch.entries) == 2, "one more capture, for the batches the example's guard excludes"
    regions = [m for m in dispatch.entries[1][1].modules() if isinstance(m, CheckpointedRegion)]
    assert len(regions) == len(plan.regions), "the plan's regions carried over to the new graph"
    measured = planner.measure(copy.deepcopy(plan.module), (example[:3],)).peak_bytes
    assert measured <= plan.budget_bytes
    predicted = plan.predicted_peak_bytes_for(example[:3])
    assert abs(predicted - measured) <= PREDICTION_TOLERANCE * measured, (predicted, measured)


def test_many_new_shapes_warn_that_each_costs_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = SizeBranching(depth=2)
    plan = planner.optimize(model, (torch.randn(16, 32),), budget_gb=1, solver="dp")
    assert plan.module is not None
    dispatch = plan.module._planner_calls
    # Every call is captured again as if no graph admitted it; the capture is the profiled one.
    recaptures: list[tuple[int, ...]] = []

    def capture_again(model: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, object]) -> Capture:
        recaptures.append(tuple(args[0].shape))
        return dispatch.profiled

    monkeypatch.setattr(GraphCall, "admits", lambda self, args, kwargs: False)
    monkeypatch.setattr("planner.rewrite.other_shapes.capture", capture_again)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in range(2, MANY_SHAPES + 4):
            plan.module(torch.randn(rows, 32))
    assert len(recaptures) == MANY_SHAPES + 2
    assert sum("captured" in str(w.message) for w in caught) == 1
