"""The records bench/fidelity.py measures and the markdown it writes from them.

Kept apart from the measuring so that the tables can be read, and rewritten, without running a model
(as compare_report.py is for compare.py): the dataclasses are what fidelity.json holds per model, and
`markdown` turns a run's reports into the tables and the list of missed targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.peers import fmt, mib, yes_no
from planner.testing.hand_methods import EVERY_BLOCK

PREDICTION_TOLERANCE = 0.05
OPTIMIZE_TARGET_S = 10.0
OPTIMIZE_TARGET_MODEL = "gpt_tiny"


@dataclass
class SweepPoint:
    fraction: float
    budget_bytes: int
    optimize_s: float
    model_unchanged_by_optimize: bool
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    relative_error: float | None = None
    fits: bool | None = None
    predicted_overhead: float | None = None
    checkpointed_regions: int | None = None
    solver: str | None = None
    infeasible_min_peak_bytes: int | None = None


@dataclass
class StepTiming:
    rounds: int
    ours_step_ms: float | None
    peer_step_ms: float
    none_step_ms: float
    ratio_ours_to_peer: float | None
    peer_overhead_vs_none: float
    ours_overhead_vs_none: float | None


@dataclass
class PeerComparison:
    peer: str
    description: str
    not_applicable: str | None = None
    gradients_equal: bool | None = None
    gradient_mismatch: str | None = None
    buffers_equal: bool | None = None
    buffer_mismatch: str | None = None
    peer_measured_peak_bytes: int | None = None
    ours_budget_bytes: int | None = None
    ours_infeasible_min_peak_bytes: int | None = None
    ours_predicted_peak_bytes: int | None = None
    ours_measured_peak_bytes: int | None = None
    ours_checkpointed_regions: int | None = None
    ours_gradients_equal: bool | None = None
    ours_buffers_equal: bool | None = None
    ours_not_above_peer: bool | None = None
    timing: StepTiming | None = None


@dataclass
class SolverLadder:
    """`dp` and `ilp` planned at the every-block peer's measured peak, timed with it in the same rounds.

    The solvers' claim: at one budget, measured step-time overhead ilp <= dp <= every block.
    """

    budget_bytes: int | None = None
    not_applicable: str | None = None
    measured_peak_bytes: dict[str, int] = field(default_factory=dict)
    predicted_recompute_ms: dict[str, float] = field(default_factory=dict)
    keeps: dict[str, int] = field(default_factory=dict)
    gradients_equal: dict[str, bool] = field(default_factory=dict)
    overhead_vs_none: dict[str, float] = field(default_factory=dict)
    """Median per-round (step / unmodified step) - 1, for "dp", "ilp" and the peer ("every block")."""
    same_plan: bool = False
    """ilp's plan is dp's (no keeps pay): one module, timed once, stands for both."""

    @property
    def ordered(self) -> bool | None:
        overhead = self.overhead_vs_none
        if not {"dp", "ilp", EVERY_BLOCK} <= set(overhead):
            return None
        return overhead["ilp"] <= overhead["dp"] <= overhead[EVERY_BLOCK]


@dataclass
class ModelReport:
    name: str
    capture: str | None = None
    solver: str | None = None
    first_optimize_s: float | None = None
    optimize_s: float | None = None
    optimize_budget_bytes: int | None = None
    mid_checkpointed_regions: int | None = None
    model_unchanged_by_optimize: bool | None = None
    lowest_predicted_peak_bytes: int | None = None
    baseline_predicted_peak_bytes: int | None = None
    baseline_measured_peak_bytes: int | None = None
    sweep: list[SweepPoint] = field(default_factory=list)
    peers: list[PeerComparison] = field(default_factory=list)
    ladder: SolverLadder | None = None
    error: str | None = None


def fidelity_table(reports: Sequence[ModelReport]) -> list[str]:
    lines = [
        "| model | f | budget MiB | predicted MiB | measured MiB | error % | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        if report.error:
            lines.append(f"| {report.name} | error: {report.error} | | | | | |")
            continue
        baseline_error = None
        if report.baseline_predicted_peak_bytes and report.baseline_measured_peak_bytes:
            baseline_error = report.baseline_predicted_peak_bytes / report.baseline_measured_peak_bytes - 1
        lines.append(
            f"| {report.name} | none | — | {mib(report.baseline_predicted_peak_bytes)} | "
            f"{mib(report.baseline_measured_peak_bytes)} | {fmt(pct(baseline_error), '+.2f')} | — |"
        )
        for point in report.sweep:
            if point.infeasible_min_peak_bytes is not None:
                predicted = f"infeasible (min {mib(point.infeasible_min_peak_bytes)})"
            else:
                predicted = mib(point.predicted_peak_bytes)
            lines.append(
                f"| {report.name} | {point.fraction:.2f} | {mib(point.budget_bytes)} | {predicted} | "
                f"{mib(point.measured_peak_bytes)} | {fmt(pct(point.relative_error), '+.2f')} | "
                f"{yes_no(point.fits)} |"
            )
    return lines


def pct(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def percent(fraction: float | None) -> str:
    return "—" if fraction is None else f"{100 * fraction:+.1f} %"


def peers_table(reports: Sequence[ModelReport]) -> list[str]:
    lines = [
        "| model | peer | grads equal | peer measured MiB | ours measured MiB | ours <= peer | "
        "step-time ratio ours/peer | peer overhead vs none | ours overhead vs none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for peer in report.peers:
            if peer.not_applicable:
                lines.append(
                    f"| {report.name} | {peer.peer} | not applicable: {peer.not_applicable} | | | | | | |"
                )
                continue
            timing = peer.timing
            grads = yes_no(peer.gradients_equal)
            if peer.buffers_equal is False:
                grads += " (buffers differ)"
            ours = mib(peer.ours_measured_peak_bytes)
            if peer.ours_infeasible_min_peak_bytes is not None:
                ours += (
                    f" (peer's peak infeasible; planned at min {mib(peer.ours_infeasible_min_peak_bytes)})"
                )
            lines.append(
                f"| {report.name} | {peer.peer} | {grads} | {mib(peer.peer_measured_peak_bytes)} | {ours} | "
                f"{yes_no(peer.ours_not_above_peer)} | "
                f"{fmt(timing.ratio_ours_to_peer if timing else None, '.3f')} | "
                f"{percent(timing.peer_overhead_vs_none if timing else None)} | "
                f"{percent(timing.ours_overhead_vs_none if timing else None)} |"
            )
    return lines


def _pair(
    values: dict[str, Any], render: Callable[[Any], str], first: str = "dp", second: str = "ilp"
) -> str:
    return f"{render(values.get(first))} / {render(values.get(second))}"


def ladder_table(reports: Sequence[ModelReport]) -> list[str]:
    lines = [
        "| model | budget MiB (every block's peak) | dp / ilp measured MiB | "
        "dp / ilp predicted recompute ms | ilp keeps | grads equal dp / ilp | "
        "overhead vs none: ilp / dp / every block | ilp <= dp <= every block |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        ladder = report.ladder
        if ladder is None:
            continue
        if ladder.not_applicable:
            lines.append(
                f"| {report.name} | {mib(ladder.budget_bytes)} | {ladder.not_applicable} | | | | | |"
            )
            continue
        overhead = ladder.overhead_vs_none
        overheads = " / ".join(percent(overhead.get(name)) for name in ("ilp", "dp", EVERY_BLOCK))
        if ladder.same_plan:
            overheads = f"same plan: {percent(overhead.get('dp'))} / {percent(overhead.get(EVERY_BLOCK))}"
        lines.append(
            f"| {report.name} | {mib(ladder.budget_bytes)} | {_pair(ladder.measured_peak_bytes, mib)} | "
            f"{_pair(ladder.predicted_recompute_ms, lambda ms: fmt(ms, '.2f'))} | "
            f"{ladder.keeps.get('ilp', 0)} | {_pair(ladder.gradients_equal, yes_no)} | {overheads} | "
            f"{yes_no(ladder.ordered)} |"
        )
    return lines


def optimize_table(reports: Sequence[ModelReport]) -> list[str]:
    lines = [
        "| model | capture | solver | regions at mid budget | optimize() s at mid budget | first call s |",
        "|---|---|---|---|---|---|",
    ]
    for report in reports:
        lines.append(
            f"| {report.name} | {report.capture or '—'} | {report.solver or '—'} | "
            f"{report.mid_checkpointed_regions if report.mid_checkpointed_regions is not None else '—'} | "
            f"{fmt(report.optimize_s, '.2f')} | {fmt(report.first_optimize_s, '.2f')} |"
        )
    return lines


def target_misses(reports: Sequence[ModelReport]) -> list[str]:
    """One line per row that misses a target; the benchmark reports, it does not assert."""
    misses = []
    for report in reports:
        if report.error:
            misses.append(f"- {report.name}: the benchmark failed: {report.error}")
        for point in report.sweep:
            if point.fits is False:
                misses.append(
                    f"- {report.name} f={point.fraction:.2f}: measured {mib(point.measured_peak_bytes)} "
                    f"MiB > budget {mib(point.budget_bytes)} MiB"
                )
            if point.relative_error is not None and abs(point.relative_error) > PREDICTION_TOLERANCE:
                misses.append(
                    f"- {report.name} f={point.fraction:.2f}: prediction error "
                    f"{100 * point.relative_error:+.2f} % (target ±{100 * PREDICTION_TOLERANCE:.0f} %)"
                )
        if report.model_unchanged_by_optimize is False:
            misses.append(f"- {report.name}: optimize() changed the model's parameters or buffers")
        if report.name == OPTIMIZE_TARGET_MODEL and report.optimize_s is not None:
            if report.optimize_s > OPTIMIZE_TARGET_S:
                misses.append(
                    f"- {report.name}: optimize() took {report.optimize_s:.2f} s "
                    f"(target <= {OPTIMIZE_TARGET_S:.0f} s)"
                )
        for peer in report.peers:
            if peer.ours_infeasible_min_peak_bytes is not None:
                misses.append(
                    f"- {report.name} vs {peer.peer}: optimize() finds no plan for the peer's "
                    f"{mib(peer.peer_measured_peak_bytes)} MiB (predicted min "
                    f"{mib(peer.ours_infeasible_min_peak_bytes)} MiB; that plan measured "
                    f"{mib(peer.ours_measured_peak_bytes)} MiB)"
                )
            if peer.ours_not_above_peer is False:
                misses.append(
                    f"- {report.name} vs {peer.peer}: ours measured {mib(peer.ours_measured_peak_bytes)} "
                    f"MiB > peer {mib(peer.peer_measured_peak_bytes)} MiB"
                )
            ratio = peer.timing.ratio_ours_to_peer if peer.timing else None
            if ratio is not None and ratio > 1.0:
                misses.append(f"- {report.name} vs {peer.peer}: ours' step time is {ratio:.3f}x the peer's")
            if peer.gradients_equal is False:
                misses.append(f"- {report.name} {peer.peer}: peer gradients differ: {peer.gradient_mismatch}")
            if peer.ours_gradients_equal is False:
                misses.append(
                    f"- {report.name} vs {peer.peer}: OUR gradients differ from the unmodified model's"
                )
            if peer.ours_buffers_equal is False:
                misses.append(
                    f"- {report.name} vs {peer.peer}: OUR buffers differ from the unmodified model's"
                )
        misses.extend(_ladder_misses(report))
    return misses or ["- none"]


def _ladder_misses(report: ModelReport) -> list[str]:
    ladder = report.ladder
    if ladder is None or ladder.not_applicable:
        return []
    misses = []
    if ladder.ordered is False:
        overheads = ", ".join(f"{name} {percent(value)}" for name, value in ladder.overhead_vs_none.items())
        misses.append(
            f"- {report.name} at {mib(ladder.budget_bytes)} MiB: measured overhead {overheads} "
            "(target ilp <= dp <= every block)"
        )
    for solver, peak in ladder.measured_peak_bytes.items():
        if ladder.budget_bytes is not None and peak > ladder.budget_bytes:
            misses.append(
                f"- {report.name} {solver}: measured {mib(peak)} MiB > {mib(ladder.budget_bytes)} MiB"
            )
    misses.extend(
        f"- {report.name} {solver}: OUR gradients differ from the unmodified model's"
        for solver, equal in ladder.gradients_equal.items()
        if not equal
    )
    return misses


def markdown(reports: Sequence[ModelReport], *, quick: bool, context: dict[str, Any]) -> str:
    mode = "quick" if quick else "full"
    load = ", ".join(f"{value:.1f}" for value in context["load_average_1_5_15_min"])
    sections = [
        f"# Fidelity benchmark ({mode} run)",
        "",
        f"{context['cpu_count']} CPUs, torch {context['torch_version']}, Python {context['python_version']}; "
        f"load average at start {load} (1/5/15 min): step times are only as clean as the machine was idle.",
        "",
        "## Fidelity: measured vs predicted peak across budgets",
        "",
        "Budget = lowest + f x (baseline - lowest), both predicted; `none` is the unmodified model. "
        "Error = (predicted - measured) / measured.",
        "",
        *fidelity_table(reports),
        "",
        "## Against hand-written checkpointing at equal or lower measured memory",
        "",
        "Ours is planned with the peer's measured peak as its budget. Step times: median of per-round "
        "ratios over interleaved training steps (Adam, default loss).",
        "",
        *peers_table(reports),
        "",
        "## ilp, dp and every-block checkpointing at one budget",
        "",
        "Both solvers plan at the every-block peer's measured peak; all three and the unmodified model are "
        "timed in the same interleaved rounds. Where ilp finds no keep worth its selective policy's cost, "
        "its plan is dp's and is timed once (same plan). Overheads within a few percent of each other "
        "are noise on a shared machine.",
        "",
        *ladder_table(reports),
        "",
        "## optimize() wall time",
        "",
        *optimize_table(reports),
        "",
        "## Targets missed",
        "",
        *target_misses(reports),
        "",
    ]
    return "\n".join(sections)
