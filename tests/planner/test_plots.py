"""The plots exist, in the formats asked for, with their axes, labels and every series (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from planner.ir import Phase, Region, RegionPolicy, Schedule
from planner.planning.plan import Plan
from planner.report.plots import (
    RankBar,
    capacity_figure,
    pareto_figure,
    pipeline_figure,
    plot_pareto,
    plot_timeline,
    timeline_figure,
    timeline_positions,
)
from planner.simulation.step import simulate, store_everything
from planner.testing.synthetic_graphs import MIB, chain_graph


@dataclass(frozen=True)
class Samples:
    samples: tuple[tuple[str, int], ...]


def make_plan() -> Plan:
    graph = chain_graph([8, 8, 8, 8, 8, 8])
    regions = (
        Region(0, 1, RegionPolicy.STORE),
        Region(1, 4, RegionPolicy.CHECKPOINT),
        Region(4, len(graph.nodes), RegionPolicy.STORE),
    )
    schedule = Schedule(regions=regions, solver="hand")
    lowest = simulate(graph, schedule).peak_bytes
    return Plan(graph=graph, schedule=schedule, budget_bytes=lowest + MIB, min_peak_bytes=lowest)


def line_by_label(axes, prefix: str):  # type: ignore[no-untyped-def]
    matches = [line for line in axes.get_lines() if line.get_label().startswith(prefix)]
    assert len(matches) == 1, [line.get_label() for line in axes.get_lines()]
    return matches[0]


def figure_labels(figure) -> list[str]:  # type: ignore[no-untyped-def]
    return [text.get_text() for legend in figure.legends for text in legend.get_texts()]


def test_timeline_has_axes_labels_and_both_predicted_series_at_their_peaks() -> None:
    plan = make_plan()
    figure = timeline_figure(plan)
    (axes,) = figure.axes
    assert axes.get_ylabel() == "live memory (MiB)"
    assert "position in the training step" in axes.get_xlabel()
    assert "1 checkpointed region" in axes.get_title()
    planned = line_by_label(axes, "predicted, with the hand plan")
    baseline = line_by_label(axes, "predicted, no checkpointing")
    assert max(planned.get_ydata()) == pytest.approx(plan.predicted_peak_bytes / MIB)
    assert max(baseline.get_ydata()) == pytest.approx(plan.baseline_peak_bytes / MIB)
    assert plan.predicted_peak_bytes < plan.baseline_peak_bytes
    budget = line_by_label(axes, "budget")
    assert set(budget.get_ydata()) == {plan.budget_bytes / MIB}
    labels = figure_labels(figure)
    assert any(label.startswith("predicted, with the hand plan") for label in labels)
    assert any(label.startswith("predicted, no checkpointing") for label in labels)
    assert any(label.startswith("parameters + optimizer state") for label in labels)


def test_timeline_draws_a_measured_series_when_given_one() -> None:
    plan = make_plan()
    measured = Samples(
        (("forward", 20 * MIB), ("forward", 30 * MIB), ("backward", 40 * MIB), ("optimizer step", 25 * MIB))
    )
    (axes,) = timeline_figure(plan, measured=measured).axes
    series = line_by_label(axes, "measured, with the plan")
    assert list(series.get_ydata()) == [20, 30, 40, 25]
    count = len(plan.graph.nodes)
    xs = list(series.get_xdata())
    assert xs[0] == 0 and count <= xs[2] < 2 * count <= xs[3], xs


def test_positions_line_up_backward_nodes_and_put_replays_just_before_them() -> None:
    plan = make_plan()
    count = len(plan.graph.nodes)
    trace = plan.simulation.trace
    positions = timeline_positions(plan.graph, trace)
    for step, position in zip(trace, positions, strict=True):
        index = plan.graph.index_of(step.node) if step.phase is not Phase.OPTIMIZER else None
        if step.phase is Phase.FORWARD:
            assert position == index
        elif step.phase is Phase.BACKWARD:
            assert position == 2 * count - 1 - index  # type: ignore[operator]
        elif step.phase is Phase.RECOMPUTE:
            assert position == 2 * count - 1 - index - 0.5  # type: ignore[operator]
        else:
            assert position == 2 * count
    baseline = timeline_positions(plan.graph, simulate(plan.graph, store_everything(plan.graph)).trace)
    assert sorted(baseline) == baseline


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plots_are_saved_in_the_format_the_suffix_names(tmp_path, suffix: str) -> None:  # type: ignore[no-untyped-def]
    plan = make_plan()
    timeline = plan.plot_timeline(tmp_path / f"nested/timeline{suffix}")
    pareto = plot_pareto(
        [(40 * MIB, 0.1), (50 * MIB, 0.0)], tmp_path / f"pareto{suffix}", budget_bytes=45 * MIB
    )
    for path in (timeline, pareto):
        content = path.read_bytes()
        assert content.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in content[:2000]


def test_unknown_suffix_and_empty_frontier_are_rejected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"\.png, \.svg, \.pdf; got .*timeline\.jpg"):
        plot_timeline(make_plan(), tmp_path / "timeline.jpg")
    with pytest.raises(ValueError, match="at least one"):
        plot_pareto([], tmp_path / "pareto.png")
    assert not list(tmp_path.iterdir())


def test_pareto_has_axes_frontier_baselines_budget_and_the_chosen_plan() -> None:
    points = [(50 * MIB, 0.0), (30 * MIB, 0.2), (40 * MIB, 0.05)]
    baselines = {"no checkpointing": (50 * MIB, 0.0), "sqrt(n) segments": (35 * MIB, 0.3)}
    figure = pareto_figure(points, budget_bytes=42 * MIB, baselines=baselines, chosen=(40 * MIB, 0.05))
    (axes,) = figure.axes
    assert axes.get_xlabel() == "predicted peak memory of the training step (MiB)"
    assert axes.get_ylabel() == "predicted recompute overhead (% of step time)"
    frontier = line_by_label(axes, "planner frontier (predicted)")
    assert list(frontier.get_xdata()) == [30, 40, 50]
    assert list(frontier.get_ydata()) == pytest.approx([20, 5, 0])
    assert set(line_by_label(axes, "budget").get_xdata()) == {42}
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert {"no checkpointing", "sqrt(n) segments", "plan for the budget"} <= set(labels)
    offsets = {tuple(c.get_offsets()[0]) for c in axes.collections if c.get_label() == "sqrt(n) segments"}
    assert offsets == {(35.0, 30.0)}


def test_capacity_figure_labels_every_bar_with_none_and_at_least() -> None:
    points = [("t4\n14.2 GiB", None, 3), ("rtx4090\n22.62 GiB", 2, 9), ("h100-80gb\n78.12 GiB", 12, 64)]
    figure = capacity_figure(points, dimension="batch", top=64, title="Largest batch")
    axes = figure.axes[0]
    labels = [text.get_text() for text in axes.texts]
    assert labels == ["none", "2", "12", "3", "9", "≥64"]
    ticks = [tick.get_text() for tick in axes.get_xticklabels()]
    assert ticks == ["t4\n14.2 GiB", "rtx4090\n22.62 GiB", "h100-80gb\n78.12 GiB"]
    assert axes.get_ylabel() == "largest batch that fits (predicted)"
    with pytest.raises(ValueError, match="at least one"):
        capacity_figure([], dimension="batch", top=1, title="")


def test_pipeline_figure_stacks_each_rank_to_its_peak_under_the_budget_line() -> None:
    gib = 2**30
    bars = [
        RankBar("rank 0", 3 * gib, gib, in_flight_bytes=70 * gib, peak_bytes=76 * gib, recompute_ms=27.3),
        RankBar("rank 1", 3 * gib, gib, in_flight_bytes=30 * gib, peak_bytes=35 * gib, recompute_ms=0.0),
    ]
    figure = pipeline_figure(bars, budget_bytes=78 * gib, title="1f1b")
    axes = figure.axes[0]
    tops = [0.0, 0.0]
    for patch in axes.patches:  # stacked bars, one part after another
        tops[round(patch.get_x() + patch.get_width() / 2)] = patch.get_y() + patch.get_height()
    assert tops == [76.0, 35.0]
    assert [text.get_text() for text in axes.texts] == [
        "76.00 GiB\nrecompute 27.3 ms",
        "35.00 GiB\nrecompute 0.0 ms",
    ]
    (budget_line,) = axes.get_lines()
    assert list(budget_line.get_ydata()) == [78.0, 78.0]
    with pytest.raises(ValueError, match="at least one rank"):
        pipeline_figure([], budget_bytes=gib, title="")
