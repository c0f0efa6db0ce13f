"""Activation-checkpoint planner for PyTorch: one call fits a training step into a memory budget.

    import planner
    plan = planner.optimize(model, example_inputs, budget_gb=8)
    print(plan.summary())
    model = plan.module
    print(planner.capacity(model, make_inputs, batch=range(1, 513), device="a100-40gb"))

The flow is capture (capture/) -> activation graph (profiler/) -> solve (solvers/) ->
rewrite (rewrite/); `profile` runs the first two once and keeps them (a `Profile`) for any number of
solves, which is what `optimize`, `pareto` and `Plan.replan` do; `measure` reports what a real
training step used. The solvers, the simulator
and `Plan` work on plain data (ir.py) and never import torch: `import planner` alone does not import
torch either, so a service can solve a posted graph without it. `optimize`, `profile`, `measure`,
`capacity` and `plan_graph` load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner.errors import (
    InfeasibleBudget,
    InvalidGraph,
    LargerShapeWarning,
    PlannerError,
    ServiceError,
    UnplannedStep,
    UnsupportedModel,
)
from planner.ir import TrainingStep
from planner.plan import Plan

if TYPE_CHECKING:
    from planner.capacity_search import Capacity, capacity
    from planner.graph_api import plan_graph
    from planner.profiler.measurement import MeasuredStep
    from planner.profiling import Profile, profile
    from planner.torch_api import measure, optimize, pareto

__all__ = [
    "Capacity",
    "InfeasibleBudget",
    "InvalidGraph",
    "LargerShapeWarning",
    "MeasuredStep",
    "Plan",
    "PlannerError",
    "Profile",
    "ServiceError",
    "TrainingStep",
    "UnplannedStep",
    "UnsupportedModel",
    "capacity",
    "measure",
    "optimize",
    "pareto",
    "plan_graph",
    "profile",
]

_LAZY = {
    "optimize": "planner.torch_api",
    "measure": "planner.torch_api",
    "pareto": "planner.torch_api",
    "plan_graph": "planner.graph_api",
    "profile": "planner.profiling",
    "Profile": "planner.profiling",
    "MeasuredStep": "planner.profiler.measurement",
    "capacity": "planner.capacity_search",
    "Capacity": "planner.capacity_search",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
