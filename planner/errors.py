"""The planner's one error hierarchy.

Every failure a user can act on is a `PlannerError`. Messages say what failed, the offending value and
the next step, so that a caught error can be shown to a person as it is. `InfeasibleBudget` is also a
`ValueError`, because asking for less memory than any plan needs is a bad argument value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.ir import Component

__all__ = [
    "GraphProblem",
    "InfeasibleBudget",
    "InvalidGraph",
    "LargerShapeWarning",
    "PlannerError",
    "ServiceError",
    "UnplannedStep",
    "UnsupportedModel",
    "format_bytes",
]

GIB = 2**30


def format_bytes(size_bytes: float) -> str:
    """Bytes as a short human string in binary units (GiB = 2**30 bytes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size_bytes) >= scale:
            return f"{size_bytes / scale:.2f} {unit}"
    return f"{int(size_bytes)} B"


class PlannerError(Exception):
    """Base class of every error the planner raises on purpose."""


class UnsupportedModel(PlannerError):
    """The model cannot be captured or rewritten; the message names the construct and a workaround."""


class UnplannedStep(PlannerError, RuntimeError):
    """A planned module ran a training step its plan did not count (e.g. gradient accumulation with a
    plan for one micro-batch); the message says how to plan that step."""


class LargerShapeWarning(UserWarning):
    """A planned module trained on inputs larger than the example it was planned with: the budget was
    made for the example, so the message gives the predicted peak at the larger shapes."""


@dataclass(frozen=True)
class GraphProblem:
    """One reason a graph is not valid, at `location` (a path into the graph document)."""

    location: tuple[str | int, ...]
    message: str

    @property
    def field(self) -> str:
        """The location written as `nodes[3].reads`."""
        text = ""
        for part in self.location:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
        return text


class InvalidGraph(PlannerError, ValueError):
    """A graph document that no solver can use: cycles, dangling storages, negative sizes, too many nodes.

    Carries `problems`, each naming the offending field, so that the REST service can answer 422 with
    one entry per field.
    """

    def __init__(self, problems: Sequence[GraphProblem]) -> None:
        self.problems = tuple(problems)
        listed = "\n".join(f"  {problem.field}: {problem.message}" for problem in self.problems)
        super().__init__(
            f"the activation graph is not valid ({len(self.problems)} problem(s)):\n{listed}\n"
            "Send the graph as `planner.serialize.graph_to_dict` writes it for a captured model."
        )


class ServiceError(PlannerError):
    """The planner service refused or failed a request; `status_code` and the server's message say why."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        self.status_code = status_code
        super().__init__(message)


class InfeasibleBudget(PlannerError, ValueError):
    """No schedule fits the budget.

    Carries `budget_bytes`, `min_peak_bytes` (the lowest peak any schedule in the plan space reaches)
    and `breakdown` (bytes by component at that minimum), and says in its message what dominates.
    """

    def __init__(
        self,
        *,
        budget_bytes: int,
        min_peak_bytes: int,
        breakdown: Mapping[Component, int],
        hint: str = "",
    ) -> None:
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.breakdown = dict(breakdown)
        message = explain_infeasible(budget_bytes, min_peak_bytes, self.breakdown)
        super().__init__(f"{message}\n{hint}" if hint else message)


def explain_infeasible(budget_bytes: int, min_peak_bytes: int, breakdown: Mapping[Component, int]) -> str:
    """The message of `InfeasibleBudget`: the shortfall and the component that dominates it."""
    static = [component for component in Component if component.static and breakdown.get(component, 0) > 0]
    static_bytes = sum(breakdown[component] for component in static)
    activation_bytes = min_peak_bytes - static_bytes
    static_names = " + ".join(component.label for component in static)
    lines = [
        f"no checkpoint plan fits a budget of {format_bytes(budget_bytes)}: the lowest achievable peak is "
        f"{format_bytes(min_peak_bytes)} ({format_bytes(min_peak_bytes - budget_bytes)} over).",
        f"{static_names} are {format_bytes(static_bytes)} of your {format_bytes(budget_bytes)}; "
        f"activations and workspace need at least {format_bytes(activation_bytes)} more.",
    ]
    if static_bytes >= budget_bytes:
        lines.append(
            "Checkpointing cannot help: the static state alone exceeds the budget. Try a smaller optimizer "
            "state (SGD, 8-bit Adam), bf16 parameters, sharding across devices, or a smaller model."
        )
    else:
        lines.append(
            f"Raise the budget to at least {format_bytes(min_peak_bytes)} (budget_bytes={min_peak_bytes}), "
            "or reduce the batch size, or train under bf16 autocast."
        )
    return "\n".join(lines)
