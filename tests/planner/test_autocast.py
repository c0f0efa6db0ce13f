"""Plans under `torch.autocast` (bf16 on the CPU): activations are profiled in bf16, and the plan still
fits, predicts within 2 % (`PREDICTION_TOLERANCE`) and trains with the original's gradients.

Planning and measuring run inside the caller's autocast block, as a training loop's forward does;
backward runs outside it, as PyTorch's mixed-precision recipe says (see NOTE [autocast] in
planner/profiler/measurement.py).
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import planner
from planner.ir import Region, RegionPolicy, Schedule
from planner.simulation.step import simulate
from planner.testing.steps import StepRecord, assert_same_step, one_step
from planner.testing.zoo_real import HUGGING_FACE, ExampleCall, build_call
from tests.planner.real_models import PREDICTION_TOLERANCE

HAS_TRANSFORMERS = importlib.util.find_spec(HUGGING_FACE) is not None


@contextmanager
def bf16() -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yield


def autocast_step(module: torch.nn.Module, call: ExampleCall) -> StepRecord:
    """One step with forward and loss under bf16 autocast and backward outside it."""

    class Autocast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, *args: object, **kwargs: object) -> object:
            with bf16():
                return self.inner(*args, **kwargs)

    return one_step(Autocast(), call.args, kwargs=call.kwargs)


@pytest.mark.parametrize(
    "name",
    [
        "tied_lm",
        "hooked_mlp",  # calls run as Python code and probed before profiling (NOTE [split calls])
        "branching_root",
        pytest.param("hf_bert", marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")),
    ],
)
def test_bf16_plan_fits_predicts_and_keeps_gradients(name: str) -> None:
    call = build_call(name)
    with bf16():
        reference = planner.optimize(call.model, call.args, example_kwargs=call.kwargs, budget_bytes=2**40)
    float32 = planner.optimize(call.model, call.args, example_kwargs=call.kwargs, budget_bytes=2**40)
    assert sum(reference.graph.storage_bytes.values()) < 0.9 * sum(float32.graph.storage_bytes.values())

    budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    with bf16():
        plan = planner.optimize(call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget)
        measured = planner.measure(
            copy.deepcopy(plan.module), call.args, example_kwargs=call.kwargs
        ).peak_bytes
    assert plan.regions, "a mid budget should checkpoint something"
    assert measured <= budget, f"{name}: measured {measured} over budget {budget}\n{plan.summary()}"
    error = abs(plan.predicted_peak_bytes - measured) / measured
    assert error <= PREDICTION_TOLERANCE, (
        f"{name}: predicted {plan.predicted_peak_bytes}, measured {measured}"
    )
    assert plan.module is not None
    assert_same_step(autocast_step(call.model, call), autocast_step(plan.module, call))


def test_a_kept_linear_under_bf16_caches_its_output_not_its_weights_cast() -> None:
    """Autocast casts a Linear's weight to bf16 and the Linear saves that cast; a selective policy
    keeping the Linear caches its output but replays the cast (planner/profiler/selective_cost.py), so the
    simulator must not hold the cast from forward to the replay. Counting the two casts of one
    checkpointed block as cached over-predicted the measured peak by 256 KiB (3.9 % on CI)."""
    call = build_call("tied_lm")
    with bf16():
        profiled = planner.profile(call.model, call.args, example_kwargs=call.kwargs)
    graph = profiled.graph
    index = {node.name: position for position, node in enumerate(graph.nodes)}
    linears = (index["blocks_1_0"], index["blocks_1_2"])
    for position in linears:
        (cast,) = graph.nodes[position].replayed_when_kept
        assert graph.storage_bytes[cast] == 128 * 512 * 2, "the bf16 copy of a 128 x 512 weight"
    block = Region(index["blocks_1_0"], index["blocks_1_3"] + 1, RegionPolicy.CHECKPOINT, keep=linears)
    regions = (
        Region(0, block.start, RegionPolicy.STORE),
        block,
        Region(block.stop, len(graph.nodes), RegionPolicy.STORE),
    )
    schedule = Schedule(regions=regions, solver="test")
    predicted = simulate(graph, schedule).peak_bytes
    with bf16():
        measured = planner.measure(
            profiled.rewrite(schedule), call.args, example_kwargs=call.kwargs
        ).peak_bytes
    assert abs(predicted - measured) < 128 * 512 * 2 // 8, f"predicted {predicted}, measured {measured}"
