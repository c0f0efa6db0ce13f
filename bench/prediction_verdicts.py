"""Whether a predicted peak is right, judged against its measurement: one rule for every bench.

Why it exists: the planner's promise is that a figure it predicts is within 2 % of what the step
measures, or says that it is an upper bound; a prediction below its measurement is the failure that
costs users (a plan over its budget, or a budget refused as impossible). bench/compare.py and
bench/compiled_check.py both judge their rows by `verdict`, so the two reports cannot drift apart.
"""

from __future__ import annotations

__all__ = ["TOLERANCE", "deviation", "verdict"]

TOLERANCE = 0.02
"""A prediction within this fraction of its measurement is right; more than this above, an upper bound."""


def deviation(predicted_bytes: int | None, measured_bytes: int | None) -> float | None:
    """(predicted - measured) / measured, or None where either is missing."""
    if predicted_bytes is None or not measured_bytes:
        return None
    return (predicted_bytes - measured_bytes) / measured_bytes


def verdict(predicted_bytes: int | None, measured_bytes: int | None) -> str:
    """ "within 2 %", "upper bound (+x %)", "**low** (-x %)", or "—" where either figure is missing."""
    off = deviation(predicted_bytes, measured_bytes)
    if off is None:
        return "—"
    if abs(off) <= TOLERANCE:
        return f"within {TOLERANCE:.0%}"
    return f"upper bound ({off:+.1%})" if off > 0 else f"**low** ({off:+.1%})"
