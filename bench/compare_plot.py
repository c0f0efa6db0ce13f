"""bench/compare.py's plot: each model's measured peak against its step-time ratio, one panel per model.

Why it exists: the tables say who won at each budget; the plot shows the whole trade-off at once, peers
and ours side by side (bench/results/compare.png, quoted in docs/benchmark.md). Kept apart from
compare_report.py, whose records it draws, so that the tables stay readable on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.compare_report import Family, Mode, ModelResult, Row
from bench.peers import MIB
from planner.testing.hand_methods import EVERY_BLOCK, OWN_SWITCH, SQRT_SEGMENTS

__all__ = ["plot"]

MIN_PEAK_SPAN = 0.02
"""A panel's peak axis spans at least this fraction of its value."""


ROW_STYLES = {
    Family.BASELINE: ("black", "none"),
    SQRT_SEGMENTS: ("tab:orange", "sqrt(n) segments"),
    EVERY_BLOCK: ("tab:red", "every block"),
    OWN_SWITCH: ("tab:brown", "own switch"),
    "compile": ("tab:purple", "compile budget"),
    "dp": ("tab:blue", "ours dp"),
    "ilp": ("tab:green", "ours ilp"),
}


def row_style(row: Row) -> tuple[str, str]:
    if row.family is Family.BASELINE:
        return ROW_STYLES[Family.BASELINE]
    if row.family is Family.OURS:
        return ROW_STYLES[row.solver or "dp"]
    return ROW_STYLES[row.method] if row.method in ROW_STYLES else ROW_STYLES["compile"]


def plot(results: Sequence[ModelResult], path: Path, *, title: str) -> None:
    """Measured peak against step-time ratio, one panel per model; circles eager, triangles compiled."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    shown = [result for result in results if result.rows]
    columns = min(4, max(1, len(shown)))
    lines_of_panels = -(-len(shown) // columns)
    figure = Figure(figsize=(4.2 * columns, 3.4 * lines_of_panels + 0.8), layout="constrained")
    axes = figure.subplots(lines_of_panels, columns, squeeze=False)
    for axis, result in zip(axes.flat, shown, strict=False):
        for row in result.rows:
            if row.peak_bytes is None or row.time_ratio_vs_none is None:
                continue
            colour, _ = row_style(row)
            marker = "o" if row.mode is Mode.EAGER else "^"
            # ours hollow and larger, so that a peer or baseline at the same point stays visible
            face = "none" if row.family is Family.OURS else colour
            size = 70 if row.family is Family.OURS else 30
            axis.scatter(
                row.time_ratio_vs_none, row.peak_bytes / MIB, marker=marker, s=size, facecolors=face,
                edgecolors=colour, linewidths=1.4,
            )  # fmt: skip
        axis.set_title(result.name, fontsize=10)
        axis.set_xlabel("step time / no checkpointing", fontsize=8)
        axis.set_ylabel("measured peak (MiB)", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.ticklabel_format(axis="y", useOffset=False, style="plain")
        low, high = axis.get_ylim()
        if high - low < MIN_PEAK_SPAN * high:  # every row at one peak: show it as a flat line, not noise
            axis.set_ylim(low * (1 - MIN_PEAK_SPAN), high * (1 + MIN_PEAK_SPAN))
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(shown) :]:
        axis.set_visible(False)
    handles = [
        Line2D([], [], color=colour, marker="s", linestyle="", label=name)
        for colour, name in ROW_STYLES.values()
    ]
    handles += [
        Line2D([], [], color="grey", marker="o", linestyle="", label="eager"),
        Line2D([], [], color="grey", marker="^", linestyle="", label="compiled"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.savefig(path, dpi=110)
