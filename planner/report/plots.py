"""Pictures of a plan: memory over the training step, and the peak-versus-overhead frontier.

Why it exists: the question users ask is "why did memory not drop?", and one picture of live
memory across forward, backward and the optimizer step answers it faster than a table: where the
peak sits, what the plan removed, what the static state (parameters, optimizer state) leaves
untouched. The frontier plot shows what each extra percent of recompute buys against the budget and
the usual baselines.

matplotlib is imported lazily, so `import planner` stays light; install it with `pip install matplotlib`
(it comes with the `plots` and `dev` extras). The figures are `matplotlib.figure.Figure` objects made
without pyplot: no backend is switched, no display is needed, nothing global is left open.
`pipeline_figure` draws each pipeline rank's predicted peak by what holds it (`PipelinePlan.plot`).
`timeline_figure`/`pareto_figure` return them for further styling; `plot_timeline`/`plot_pareto` save
them in the format the path's suffix names (`.png`, `.svg`, `.pdf`). Nothing here imports torch:
a measured series is any object with `samples`, a sequence of (phase, live bytes) pairs, such as
`planner.profiler.measurement.MeasuredTimeline`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from planner.errors import format_bytes
from planner.ir import ActivationGraph, Phase, Schedule, TraceStep

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from planner.solvers.solved_plan import SolvedPlan

__all__ = [
    "MeasuredSeries",
    "RankBar",
    "capacity_figure",
    "pareto_figure",
    "pipeline_figure",
    "plot_capacity",
    "plot_pareto",
    "plot_pipeline",
    "plot_timeline",
    "timeline_figure",
    "timeline_positions",
]

PHASE_COLOURS = {"forward": "#dbe9f6", "backward": "#fde2cf", "optimizer step": "#e0f0dc"}
"""Background colour of each phase of the step (the measured series uses the same phase names)."""

OPTIMIZER_WIDTH = 0.06
"""Width of the optimizer step on the x-axis, as a fraction of the forward+backward width."""

SUFFIXES = (".png", ".svg", ".pdf")

REGION_COLOURS = ("#b07cc6", "#7b3294")
"""Checkpointed regions alternate colours so that adjacent regions stay apart."""

RECOMPUTE_OFFSET = 0.5
"""A replay is drawn this many node positions before the backward node that triggers it."""


class MeasuredSeries(Protocol):
    """A measured timeline: (phase, live bytes) samples in step order."""

    @property
    def samples(self) -> Sequence[tuple[str, int]]: ...


def _new_figure(width_inches: float, height_inches: float) -> Figure:
    """A matplotlib Figure that belongs to no pyplot state, so no backend is switched or leaked."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "planner's plots need matplotlib: pip install matplotlib (or pip install 'planner[plots]')"
        ) from error
    return Figure(figsize=(width_inches, height_inches), layout="constrained")


@dataclass(frozen=True)
class _Scale:
    """Bytes per unit of the y-axis, chosen so the peak reads as a small number."""

    divisor: int
    unit: str

    @classmethod
    def for_bytes(cls, largest_bytes: float) -> _Scale:
        for divisor, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if largest_bytes >= divisor:
                return cls(divisor, unit)
        return cls(1, "B")


def timeline_positions(graph: ActivationGraph, trace: Sequence[TraceStep]) -> list[float]:
    """x position of each trace step: forward node i at i, its backward at 2n-1-i, the step at 2n.

    Replays sit `RECOMPUTE_OFFSET` before the backward node that triggers them, so a plan's trace and
    the baseline's (which has no replays) line up node for node.
    """
    count = len(graph.nodes)
    index_of = {node.name: index for index, node in enumerate(graph.nodes)}
    positions: list[float] = []
    for step in trace:
        if step.phase is Phase.FORWARD:
            positions.append(float(index_of[step.node]))
        elif step.phase.after_backward:
            positions.append(float(2 * count))
        else:
            backward = 2 * count - 1 - index_of[step.node]
            positions.append(backward - (RECOMPUTE_OFFSET if step.phase is Phase.RECOMPUTE else 0.0))
    return positions


def _phase_spans(count: int) -> dict[str, tuple[float, float]]:
    """x-axis span of each phase for a graph of `count` nodes (see `timeline_positions`)."""
    return {
        "forward": (0.0, float(count)),
        "backward": (float(count), float(2 * count)),
        "optimizer step": (float(2 * count), 2 * count * (1 + OPTIMIZER_WIDTH)),
    }


def _step_series(
    graph: ActivationGraph, trace: Sequence[TraceStep], scale: _Scale
) -> tuple[list[float], list[float]]:
    positions = timeline_positions(graph, trace)
    values = [step.live_bytes / scale.divisor for step in trace]
    _, end = _phase_spans(len(graph.nodes))["optimizer step"]
    return [*positions, end], [*values, values[-1]]


def _measured_series(
    graph: ActivationGraph, measured: MeasuredSeries, scale: _Scale
) -> tuple[list[float], list[float]]:
    """Measured samples stretched over each phase's span (operators do not map one-to-one to nodes)."""
    xs: list[float] = []
    ys: list[float] = []
    for phase, (start, stop) in _phase_spans(len(graph.nodes)).items():
        values = [live_bytes for name, live_bytes in measured.samples if name == phase]
        for index, live_bytes in enumerate(values):
            xs.append(start + (stop - start) * index / len(values))
            ys.append(live_bytes / scale.divisor)
    return xs, ys


def _shade_phases(axes: Axes, count: int) -> None:
    for name, (start, stop) in _phase_spans(count).items():
        axes.axvspan(start, stop, color=PHASE_COLOURS[name], zorder=0, linewidth=0)
        axes.text(
            (start + stop) / 2,
            0.985,
            name if name != "optimizer step" else "optim.",
            transform=axes.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=9,
            color="#444444",
        )


def _mark_regions(axes: Axes, graph: ActivationGraph, schedule: Schedule) -> None:
    """A numbered bar at the bottom for each checkpointed region, in forward and mirrored in backward."""
    count = len(graph.nodes)
    for number, region in enumerate(schedule.checkpointed, start=1):
        colour = REGION_COLOURS[number % len(REGION_COLOURS)]
        for start, stop in ((region.start, region.stop), (2 * count - region.stop, 2 * count - region.start)):
            axes.axvspan(start, stop, ymin=0.0, ymax=0.025, color=colour, linewidth=0, zorder=2)
            axes.text(
                (start + stop) / 2,
                0.03,
                str(number),
                transform=axes.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=7,
                color=colour,
            )


def _timeline_title(plan: SolvedPlan) -> str:
    regions = len(plan.schedule.checkpointed)
    if not regions:
        return "Memory over one training step: nothing checkpointed"
    return f"Memory over one training step: {regions} checkpointed region{'s' * (regions > 1)} (purple bars)"


def timeline_figure(plan: SolvedPlan, *, measured: MeasuredSeries | None = None) -> Figure:
    """Live memory over one training step, predicted with the plan and without checkpointing.

    `measured`, e.g. `planner.profiler.measurement.measure_timeline(plan.module, inputs)`, adds the measured
    series of the planned module.
    """
    graph, count = plan.graph, len(plan.graph.nodes)
    largest = max(plan.baseline_peak_bytes, plan.predicted_peak_bytes, plan.budget_bytes)
    if measured is not None:
        largest = max(largest, *(live_bytes for _, live_bytes in measured.samples))
    scale = _Scale.for_bytes(largest)
    figure = _new_figure(9, 5.4)
    axes = figure.subplots()
    _shade_phases(axes, count)
    axes.axhspan(
        0,
        graph.static.resident_bytes / scale.divisor,
        color="#bbbbbb",
        alpha=0.35,
        zorder=1,
        linewidth=0,
        label="parameters + optimizer state + inputs (no plan changes them)",
    )
    xs, ys = _step_series(graph, plan.simulation.trace, scale)
    axes.step(
        xs,
        ys,
        where="post",
        color="#1b9e77",
        linewidth=2.6,
        zorder=3,
        label=f"predicted, with the {plan.solver} plan (peak {format_bytes(plan.predicted_peak_bytes)})",
    )
    xs, ys = _step_series(graph, plan.baseline.trace, scale)
    axes.step(
        xs,
        ys,
        where="post",
        color="#d95f02",
        linewidth=1.2,
        zorder=4,
        label=f"predicted, no checkpointing (peak {format_bytes(plan.baseline_peak_bytes)})",
    )
    if measured is not None:
        xs, ys = _measured_series(graph, measured, scale)
        axes.plot(
            xs,
            ys,
            color="#222222",
            linewidth=1.1,
            linestyle=":",
            zorder=5,
            label="measured, with the plan (per operator, stretched over each phase)",
        )
    axes.axhline(
        plan.budget_bytes / scale.divisor,
        color="#c0392b",
        linestyle="--",
        linewidth=1.2,
        zorder=2,
        label=f"budget {format_bytes(plan.budget_bytes)}",
    )
    _mark_regions(axes, graph, plan.schedule)
    axes.set_xlim(0, _phase_spans(count)["optimizer step"][1])
    axes.set_ylim(0, largest / scale.divisor * 1.18)
    axes.set_xlabel("position in the training step (graph nodes: forward, then backward in reverse)")
    axes.set_ylabel(f"live memory ({scale.unit})")
    axes.set_title(_timeline_title(plan), fontsize=11)
    figure.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return figure


def plot_timeline(plan: SolvedPlan, path: str | Path, *, measured: MeasuredSeries | None = None) -> Path:
    """Save `timeline_figure(plan, measured=measured)` to `path` (.png, .svg or .pdf); returns the path."""
    target = _target(path)
    return _save(timeline_figure(plan, measured=measured), target)


def pareto_figure(
    points: Sequence[tuple[int, float]],
    *,
    budget_bytes: int | None = None,
    baselines: Mapping[str, tuple[int, float]] | None = None,
    chosen: tuple[int, float] | None = None,
) -> Figure:
    """Predicted peak against predicted overhead for plans on the frontier.

    `points` are (peak bytes, overhead as a fraction of the step) pairs from any frontier or budget
    sweep; `baselines` maps a label (e.g. "no checkpointing", "sqrt(n) segments", "every block") to
    its point; `chosen` highlights the plan picked for the budget.
    """
    if not points:
        raise ValueError("a Pareto plot needs at least one (peak_bytes, overhead) point, got none")
    extra = list((baselines or {}).values()) + ([chosen] if chosen else [])
    largest = max(peak for peak, _ in [*points, *extra])
    if budget_bytes is not None:
        largest = max(largest, budget_bytes)
    scale = _Scale.for_bytes(largest)
    frontier = sorted(points)
    figure = _new_figure(7.5, 4.8)
    axes = figure.subplots()
    axes.step(
        [peak / scale.divisor for peak, _ in frontier],
        [100 * overhead for _, overhead in frontier],
        where="post",
        color="#1b9e77",
        linewidth=2,
        marker="o",
        markersize=4,
        zorder=3,
        label="planner frontier (predicted)",
    )
    markers = ("s", "^", "D", "v", "P", "X")
    for (label, (peak, overhead)), marker in zip((baselines or {}).items(), markers * 4, strict=False):
        axes.scatter(peak / scale.divisor, 100 * overhead, marker=marker, s=60, zorder=4, label=label)
    if chosen is not None:
        axes.scatter(
            chosen[0] / scale.divisor,
            100 * chosen[1],
            s=160,
            facecolors="none",
            edgecolors="#c0392b",
            linewidths=2,
            zorder=5,
            label="plan for the budget",
        )
    if budget_bytes is not None:
        axes.axvline(
            budget_bytes / scale.divisor,
            color="#c0392b",
            linestyle="--",
            linewidth=1.2,
            label=f"budget {format_bytes(budget_bytes)}",
        )
        axes.axvspan(
            budget_bytes / scale.divisor,
            largest / scale.divisor * 1.05,
            color="#c0392b",
            alpha=0.06,
            linewidth=0,
        )
    axes.set_xlim(left=0, right=largest / scale.divisor * 1.05)
    axes.set_ylim(bottom=0)
    axes.set_xlabel(f"predicted peak memory of the training step ({scale.unit})")
    axes.set_ylabel("predicted recompute overhead (% of step time)")
    axes.set_title("Peak memory vs recompute: every plan on the frontier", fontsize=11)
    axes.legend(fontsize=8, framealpha=0.9)
    axes.grid(alpha=0.3)
    return figure


def plot_pareto(
    points: Sequence[tuple[int, float]],
    path: str | Path,
    *,
    budget_bytes: int | None = None,
    baselines: Mapping[str, tuple[int, float]] | None = None,
    chosen: tuple[int, float] | None = None,
) -> Path:
    """Save `pareto_figure(points, ...)` to `path` (.png, .svg or .pdf); returns the path."""
    target = _target(path)
    figure = pareto_figure(points, budget_bytes=budget_bytes, baselines=baselines, chosen=chosen)
    return _save(figure, target)


def _bar_label(value: int | None, top: int) -> str:
    if value is None:
        return "none"
    return f"≥{value}" if value >= top else str(value)


def capacity_figure(
    points: Sequence[tuple[str, int | None, int | None]], *, dimension: str, top: int, title: str
) -> Figure:
    """The largest size that fits on each card, without and with checkpointing.

    `points` are (the card's label, largest size without, largest size with checkpointing), None where
    not even the smallest size fits; a size equal to `top`, the largest searched, may be an
    underestimate and is labelled ">=".
    """
    if not points:
        raise ValueError("a capacity plot needs at least one (label, without, with) point, got none")
    figure = _new_figure(7.5, 4.6)
    axes = figure.subplots()
    positions = list(range(len(points)))
    width = 0.38
    series = (
        ("without checkpointing", [without for _, without, _ in points], "#d95f02", -width / 2),
        ("with the planner's checkpointing", [with_plan for _, _, with_plan in points], "#1b9e77", width / 2),
    )
    for label, values, colour, offset in series:
        heights = [value or 0 for value in values]
        bars = axes.bar([x + offset for x in positions], heights, width, color=colour, label=label, zorder=3)
        for bar, value in zip(bars, values, strict=True):
            axes.annotate(
                _bar_label(value, top),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    axes.set_xticks(positions, [label for label, _, _ in points], fontsize=8)
    tallest = max([value or 0 for _, *values in points for value in values] + [1])
    axes.set_ylim(0, tallest * 1.18)
    axes.set_xlabel("card (the budget a training step may use on it)")
    axes.set_ylabel(f"largest {dimension} that fits (predicted)")
    axes.set_title(title, fontsize=11)
    axes.legend(fontsize=8, framealpha=0.9, loc="upper left")
    axes.grid(axis="y", alpha=0.3, zorder=0)
    return figure


def plot_capacity(
    points: Sequence[tuple[str, int | None, int | None]],
    path: str | Path,
    *,
    dimension: str,
    top: int,
    title: str,
) -> Path:
    """Save `capacity_figure(points, ...)` to `path` (.png, .svg or .pdf); returns the path."""
    target = _target(path)
    return _save(capacity_figure(points, dimension=dimension, top=top, title=title), target)


@dataclass(frozen=True)
class RankBar:
    """One pipeline rank's predicted peak by what holds it (bytes), and its recompute per micro-batch."""

    label: str
    state_bytes: int
    """Parameters, gradients' shares and optimizer state of the rank's stages."""
    buffer_bytes: int
    """The schedule's receive buffers and the rank's share of the batch."""
    in_flight_bytes: int
    """What the micro-batches in flight at the peak hold (saved activations and outputs)."""
    peak_bytes: int
    recompute_ms: float


PIPELINE_PARTS = (
    ("parameters and optimizer state", "#7570b3"),
    ("receive buffers and batch", "#e7298a"),
    ("micro-batches in flight", "#1b9e77"),
    ("the rest at the peak (gradients, the step's own tensors)", "#bdbdbd"),
)


def pipeline_figure(bars: Sequence[RankBar], *, budget_bytes: int, title: str) -> Figure:
    """Each pipeline rank's predicted peak, stacked by what holds it, against the per-device budget, with
    each rank's recompute per micro-batch above its bar."""
    if not bars:
        raise ValueError("a pipeline plot needs at least one rank, got none")
    figure = _new_figure(7.5, 4.6)
    axes = figure.subplots()
    positions = list(range(len(bars)))
    bottoms = [0.0] * len(bars)
    gib = float(2**30)
    for (label, colour), part in zip(PIPELINE_PARTS, _pipeline_parts(bars), strict=True):
        heights = [value / gib for value in part]
        axes.bar(positions, heights, 0.6, bottom=bottoms, color=colour, label=label, zorder=3)
        bottoms = [bottom + height for bottom, height in zip(bottoms, heights, strict=True)]
    for position, bar in zip(positions, bars, strict=True):
        axes.annotate(
            f"{format_bytes(bar.peak_bytes)}\nrecompute {bar.recompute_ms:.1f} ms",
            (position, bar.peak_bytes / gib),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    axes.axhline(budget_bytes / gib, color="#d95f02", linestyle="--", linewidth=1.2, label="budget", zorder=4)
    axes.set_xticks(positions, [bar.label for bar in bars], fontsize=8)
    axes.set_ylim(0, max([bar.peak_bytes for bar in bars] + [budget_bytes]) / gib * 1.5)
    axes.set_ylabel("predicted peak per device (GiB)")
    axes.set_title(title, fontsize=11)
    axes.legend(fontsize=7, framealpha=0.9, loc="upper right")
    axes.grid(axis="y", alpha=0.3, zorder=0)
    return figure


def _pipeline_parts(bars: Sequence[RankBar]) -> list[list[int]]:
    """The stacked heights of `PIPELINE_PARTS`, bar by bar; the last is what the peak holds besides."""
    parts: list[list[int]] = [[], [], [], []]
    for bar in bars:
        named = (bar.state_bytes, bar.buffer_bytes, bar.in_flight_bytes)
        for part, value in zip(parts, (*named, max(0, bar.peak_bytes - sum(named))), strict=True):
            part.append(value)
    return parts


def plot_pipeline(bars: Sequence[RankBar], path: str | Path, *, budget_bytes: int, title: str) -> Path:
    """Save `pipeline_figure(bars, ...)` to `path` (.png, .svg or .pdf); returns the path."""
    target = _target(path)
    return _save(pipeline_figure(bars, budget_bytes=budget_bytes, title=title), target)


def _target(path: str | Path) -> Path:
    target = Path(path)
    if target.suffix.lower() not in SUFFIXES:
        raise ValueError(f"save plots as one of {', '.join(SUFFIXES)}; got {str(path)!r}")
    return target


def _save(figure: Figure, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=150)
    return target
