"""What a solver child process runs (api/solve_process.py): request JSON text in, answer JSON text out.

These are the service's two solves, kept apart from the supervisor so that the forkserver can import
them once for every child. Both are pure functions of their request; neither touches the job store.
"""

from __future__ import annotations

import json

from planner.planning.graph import pareto_frontier, plan_graph
from planner.serialize import graph_from_dict
from planner.simulation.allocator import AllocatorSettings

from .schemas import ParetoView

__all__ = ["solve_pareto", "solve_plan"]


def solve_plan(request_json: str) -> str:
    """A stored job's request (`{"graph", "budget_bytes", "solver"}`, and "budget_kind" with
    "allocator_conf" unless the kind is "allocated") -> its plan (`planner.plan/v1`)."""
    request = json.loads(request_json)
    plan = plan_graph(
        graph_from_dict(request["graph"]),
        budget_bytes=int(request["budget_bytes"]),
        solver=str(request["solver"]),
        budget_kind=str(request.get("budget_kind", "allocated")),
        allocator=AllocatorSettings.from_conf(str(request.get("allocator_conf", ""))),
    )
    return json.dumps(plan.to_dict(), separators=(",", ":"), allow_nan=False)


def solve_pareto(request_json: str) -> str:
    """`{"graph", "budgets_bytes", "points", "solver"}` -> the frontier as a `ParetoView`."""
    request = json.loads(request_json)
    frontier = pareto_frontier(
        graph_from_dict(request["graph"]),
        budgets_bytes=request["budgets_bytes"],
        points=request["points"],
        solver=request["solver"],
    )
    return ParetoView.of(frontier).model_dump_json()
