"""Activation-checkpoint planner for PyTorch: one call fits a training step into a memory budget.

    import planner
    plan = planner.optimize(model, example_inputs, budget_gb=8)
    print(plan.summary())
    model = plan.module
    print(planner.capacity(model, make_inputs, batch=range(1, 513), device="a100-40gb"))

The flow is capture (capture/) -> activation graph (profiler/) -> solve (solvers/) -> rewrite
(rewrite/), on the contract (ir.py) and a torch-free model of a step's memory (simulation/); a solved
plan is explained by report/, and planning/ puts the pipeline together (`Plan`, `profile`,
`plan_graph`), with compiled/ for `compile=True`, one_call for `optimize`, `pareto` and `measure`,
pipelining/ for `optimize_pipeline` (a plan per stage of a pipeline schedule) and sizing/ for
`capacity`; docs/layout.md draws the stages and what each may import. `profile` runs the first two
stages once and keeps them (a `Profile`) for any number of solves, which is what `optimize`,
`pareto` and `Plan.replan` do; `measure` reports what a real training step used. The solvers, the
simulator and `Plan` work on plain data (ir.py) and never import torch: `import planner` alone does not
import torch either, so a service can solve a posted graph without it. `optimize`, `profile`,
`measure`, `capacity` and `plan_graph` load on first use; the enums of the string options
(`CostModel`, `Sharding`, `MemoryCounting`, `BudgetKind`) are ir.py's.
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
from planner.ir import BudgetKind, CostModel, MemoryCounting, Sharding, TrainingStep
from planner.planning.plan import Plan

if TYPE_CHECKING:
    from planner.one_call import measure, optimize, pareto
    from planner.pipelining import PipelinePlan, optimize_pipeline
    from planner.planning.graph import plan_graph
    from planner.planning.model import Profile, profile
    from planner.profiler.measurement import MeasuredStep
    from planner.sizing.capacity import Capacity, capacity

__all__ = [
    "BudgetKind",
    "Capacity",
    "CostModel",
    "InfeasibleBudget",
    "InvalidGraph",
    "LargerShapeWarning",
    "MeasuredStep",
    "MemoryCounting",
    "PipelinePlan",
    "Plan",
    "PlannerError",
    "Profile",
    "ServiceError",
    "Sharding",
    "TrainingStep",
    "UnplannedStep",
    "UnsupportedModel",
    "capacity",
    "measure",
    "optimize",
    "optimize_pipeline",
    "pareto",
    "plan_graph",
    "profile",
]

_LAZY = {
    "optimize": "planner.one_call",
    "measure": "planner.one_call",
    "pareto": "planner.one_call",
    "optimize_pipeline": "planner.pipelining",
    "PipelinePlan": "planner.pipelining",
    "plan_graph": "planner.planning.graph",
    "profile": "planner.planning.model",
    "Profile": "planner.planning.model",
    "MeasuredStep": "planner.profiler.measurement",
    "capacity": "planner.sizing.capacity",
    "Capacity": "planner.sizing.capacity",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
