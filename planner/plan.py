"""`Plan`: what `optimize` returns, the checkpointed module plus the predictions that justify it.

Every figure a Plan reports is a prediction of the simulator, labelled as such; `planner.measure`
gives the measured counterpart. A Plan round-trips through JSON (`planner.plan/v1`) without torch;
a plan loaded from JSON has no module until `apply` rewrites a model with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.errors import format_bytes
from planner.ir import PLAN_SCHEMA, ActivationGraph, Schedule, SimulationResult
from planner.serialize import graph_from_dict, graph_to_dict, schedule_from_dict, schedule_to_dict
from planner.simulate import simulate, store_everything

if TYPE_CHECKING:
    import torch

__all__ = ["Plan", "RegionSummary"]


@dataclass(frozen=True)
class RegionSummary:
    """A checkpointed region in the model's own names."""

    first_node: str
    last_node: str
    modules: tuple[str, ...]
    node_count: int


@dataclass
class Plan:
    """A schedule for one model and budget, with predicted peak and overhead."""

    graph: ActivationGraph
    schedule: Schedule
    budget_bytes: int
    min_peak_bytes: int
    solve_ms: float = 0.0
    module: torch.nn.Module | None = field(default=None, repr=False)
    simulation: SimulationResult = field(init=False, repr=False)
    baseline: SimulationResult = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.simulation = simulate(self.graph, self.schedule)
        self.baseline = simulate(self.graph, store_everything(self.graph))

    @property
    def predicted_peak_bytes(self) -> int:
        return self.simulation.peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        """Predicted peak without checkpointing, with the same accounting."""
        return self.baseline.peak_bytes

    @property
    def predicted_overhead(self) -> float:
        """Predicted recompute time over the predicted step time without checkpointing."""
        return self.simulation.overhead

    @property
    def capture(self) -> str:
        return self.graph.capture

    @property
    def solver(self) -> str:
        return self.schedule.solver

    @property
    def regions(self) -> list[RegionSummary]:
        """The checkpointed regions, in execution order."""
        summaries = []
        for region in self.schedule.checkpointed:
            nodes = self.graph.nodes[region.start : region.stop]
            modules = tuple(dict.fromkeys(node.module_path for node in nodes if node.module_path))
            summaries.append(
                RegionSummary(
                    first_node=nodes[0].name, last_node=nodes[-1].name, modules=modules, node_count=len(nodes)
                )
            )
        return summaries

    def summary(self) -> str:
        """A plain-text report: budget, predicted peaks, what sets the peak, the regions."""
        result = self.simulation
        saved = self.baseline_peak_bytes - self.predicted_peak_bytes
        lines = [
            f"checkpoint plan ({self.solver} solver, captured by {self.capture}, "
            f"optimizer {self.graph.optimizer})",
            f"  budget                 {format_bytes(self.budget_bytes):>12}",
            f"  predicted peak         {format_bytes(self.predicted_peak_bytes):>12}  "
            f"(set in {result.peak_phase.value} at {result.peak_node})",
            f"  predicted baseline     {format_bytes(self.baseline_peak_bytes):>12}  (no checkpointing)",
            f"  lowest achievable      {format_bytes(self.min_peak_bytes):>12}  (predicted)",
            f"  predicted saving       {format_bytes(saved):>12}",
            f"  predicted overhead     {self.predicted_overhead:>11.1%}  "
            f"(recompute {result.recompute_ms:.1f} ms of a {result.step_ms:.1f} ms step, measured per node)",
            "  at the predicted peak:",
        ]
        for component, size_bytes in result.breakdown.items():
            if size_bytes:
                lines.append(f"    {component.replace('_', ' '):<20} {format_bytes(size_bytes):>12}")
        regions = self.regions
        lines.append(f"  checkpointed regions: {len(regions)} of {len(self.graph.nodes)} nodes' regions")
        for number, region in enumerate(regions):
            where = _describe_modules(region.modules) or f"{region.first_node} .. {region.last_node}"
            lines.append(f"    {number + 1}. {where} ({region.node_count} nodes)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "budget_bytes": self.budget_bytes,
            "min_peak_bytes": self.min_peak_bytes,
            "solve_ms": self.solve_ms,
            "predicted": {
                "peak_bytes": self.predicted_peak_bytes,
                "baseline_peak_bytes": self.baseline_peak_bytes,
                "overhead": self.predicted_overhead,
                "peak_phase": self.simulation.peak_phase.value,
            },
            "schedule": schedule_to_dict(self.schedule),
            "graph": graph_to_dict(self.graph),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("schema") != PLAN_SCHEMA:
            raise ValueError(f"expected a {PLAN_SCHEMA!r} document, got schema={data.get('schema')!r}")
        return cls(
            graph=graph_from_dict(data["graph"]),
            schedule=schedule_from_dict(data["schedule"]),
            budget_bytes=int(data["budget_bytes"]),
            min_peak_bytes=int(data["min_peak_bytes"]),
            solve_ms=float(data.get("solve_ms", 0.0)),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def __repr__(self) -> str:
        return (
            f"Plan(solver={self.solver!r}, budget={format_bytes(self.budget_bytes)}, "
            f"predicted_peak={format_bytes(self.predicted_peak_bytes)}, "
            f"predicted_overhead={self.predicted_overhead:.1%}, regions={len(self.schedule.checkpointed)})"
        )


def _describe_modules(modules: tuple[str, ...]) -> str:
    if not modules:
        return ""
    if len(modules) <= 3:
        return ", ".join(modules)
    return f"{modules[0]} .. {modules[-1]} ({len(modules)} modules)"
