"""The planner's one error hierarchy.

Every failure a user can act on is a `PlannerError`. Messages say what failed, the offending value and
the next step, so that a caught error can be shown to a person as it is. `InfeasibleBudget` is also a
`ValueError`, because asking for less memory than any plan needs is a bad argument value.
"""

from __future__ import annotations

__all__ = ["PlannerError", "InfeasibleBudget", "UnsupportedModel", "format_bytes"]

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


class InfeasibleBudget(PlannerError, ValueError):
    """No schedule fits the budget.

    Carries `budget_bytes`, `min_peak_bytes` (the lowest peak any schedule in the plan space reaches)
    and `breakdown` (bytes by component at that minimum), and says in its message what dominates.
    """

    def __init__(self, *, budget_bytes: int, min_peak_bytes: int, breakdown: dict[str, int]) -> None:
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.breakdown = dict(breakdown)
        super().__init__(explain_infeasible(budget_bytes, min_peak_bytes, self.breakdown))


def explain_infeasible(budget_bytes: int, min_peak_bytes: int, breakdown: dict[str, int]) -> str:
    """The message of `InfeasibleBudget`: the shortfall and the component that dominates it."""
    static_keys = ("parameters", "gradients", "optimizer_state", "inputs")
    static_bytes = sum(breakdown.get(key, 0) for key in static_keys)
    activation_bytes = min_peak_bytes - static_bytes
    static_names = " + ".join(key.replace("_", " ") for key in static_keys if breakdown.get(key, 0) > 0)
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
