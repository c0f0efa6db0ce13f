"""The real-model zoo's entries as test parameters, and the plan the real-model tests share.

`entries` marks an entry skipped when the package it needs (`transformers`, `diffusers`) is not
installed (both are in the `dev` extra). `plan_at_mid_budget` plans an entry with the `dp` solver
halfway between its own predicted lowest and no-checkpointing peaks; the `mid_budget_plan` fixture
(conftest.py) makes it once a session.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import planner
from planner.testing.zoo_real import LIBRARY_ZOO, REAL_ZOO, ExampleCall, build_call

PREDICTION_TOLERANCE = 0.02
MID_BUDGET_FRACTION = 0.5
SOLVER = "dp"
PLANNABLE = list(REAL_ZOO)


def needs(name: str) -> list[pytest.MarkDecorator]:
    requires = (REAL_ZOO.get(name) or LIBRARY_ZOO[name]).requires
    if requires is not None and importlib.util.find_spec(requires) is None:
        return [pytest.mark.skip(reason=f"needs {requires} (pip install -e '.[dev]')")]
    return []


def entries(names: list[str]) -> list[Any]:
    return [pytest.param(name, marks=needs(name)) for name in names]


@dataclass(frozen=True)
class MidBudgetPlan:
    """A real-zoo entry's example call, its plan and the budget it was planned for."""

    call: ExampleCall
    plan: planner.Plan
    budget_bytes: int


def plan_at_mid_budget(name: str) -> MidBudgetPlan:
    call = build_call(name)
    reference = planner.optimize(call.model, call.args, example_kwargs=call.kwargs, budget_bytes=2**40)
    lowest, baseline = reference.min_peak_bytes, reference.baseline_peak_bytes
    budget = int(lowest + MID_BUDGET_FRACTION * (baseline - lowest))
    plan = planner.optimize(
        call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget, solver=SOLVER
    )
    return MidBudgetPlan(call=call, plan=plan, budget_bytes=budget)


MidBudgetPlanner = Callable[[str], MidBudgetPlan]
"""The `mid_budget_plan` fixture: an entry's name to its (cached) mid-budget plan."""


def measured_peak_bytes(
    name: str, module: torch.nn.Module, call: ExampleCall, *, routes_by_value: bool = False
) -> int:
    """Two Adam steps of `module` (a copy of a plan's, or a hand method's), measured in 512-byte blocks.

    NOTE [routing by value]: an entry that routes tokens by value (`RealModel.routes_by_value`, or
    `routes_by_value` for a model outside the real zoo) is profiled and planned at the example's
    routing, and Adam's first step moves the routing: on moe_transformer, the plan at its lowest peak
    measured 512 bytes over with Adam at lr 1e-3 and 512 under at lr 0; on zoo_dag's inline mixture of
    experts, √n segments measured 207,872 bytes (0.26 %) over their prediction at lr 1e-3 and exactly it
    at lr 0. Such entries are measured with Adam at learning rate 0, which keeps the optimizer's memory
    and the routing (and the weights of a module that shares them with the profiled model, which a
    measurement at lr 1e-3 moves for every later one); docs/limits.md says what the drift means for a
    user."""
    entry = REAL_ZOO.get(name)
    if routes_by_value or (entry is not None and entry.routes_by_value):
        frozen = torch.optim.Adam(module.parameters(), lr=0.0)
        return planner.measure(module, call.args, example_kwargs=call.kwargs, optimizer=frozen).peak_bytes
    return planner.measure(module, call.args, example_kwargs=call.kwargs).peak_bytes
