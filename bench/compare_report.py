"""What bench/compare.py measured, as tables and verdicts: pure functions of its result records.

Why it exists: the benchmark runs for many minutes and asserts nothing, so what it claims lives in how
its records are judged and shown. Keeping the records (`Row`, `ModelResult`) and their rendering apart
from the measuring lets tests check every verdict on hand-made records in milliseconds, and keeps the
worker-to-parent JSON (`result_from_dict`) next to the records it rebuilds.

A row of ours is judged against the peer whose measured peak was its budget (`matches_peer`): within
that budget, and a step time not measurably above the peer's: per round, our step time over the
peer's (both run in the round), and the 95 % interval of the median of those ratios reaching 1 or below
(NOTE [timing noise] in bench/peers.py). Eager and compiled rows go into separate tables, since their
peaks are counted differently (`peak_source`), and a run on another device writes files of its own.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from bench.peers import fmt, median_interval, mib, yes_no
from bench.prediction_verdicts import verdict

__all__ = [
    "NO_CHECKPOINTING",
    "SOLVERS",
    "Family",
    "ModelResult",
    "Mode",
    "Row",
    "Tally",
    "TrackerCheck",
    "label",
    "markdown",
    "matches_peer",
    "misses",
    "result_from_dict",
    "summary_table",
    "tally",
    "tally_table",
    "time_vs_peer",
]

NO_CHECKPOINTING = "no checkpointing"
SOLVERS = ("dp", "ilp")
"""Our solvers, one row each per peer."""
REASON_CHARACTERS = 160
"""Characters of a "not applicable" or error reason shown in a table (the JSON has all of it)."""


class Mode(StrEnum):
    """How a row's training step runs."""

    EAGER = "eager"
    """The module as written, run op by op."""
    COMPILED = "compiled"
    """torch.compile with inductor (see NOTE [measuring compiled steps])."""


REFERENCES = {
    Mode.EAGER: "the unmodified eager model's",
    Mode.COMPILED: "compiled no checkpointing's (same dropout masks)",
}
"""What a row's gradients are compared with (bench/compare_measurement.py, NOTE [compiled gradients])."""


class Family(StrEnum):
    """Whose row it is."""

    BASELINE = "baseline"
    """No checkpointing: the denominator of every step-time ratio in its mode."""
    PEER = "peer"
    """What users pick today."""
    OURS = "ours"
    """planner.optimize at a peer's measured peak."""


@dataclass
class Row:
    """One variant of one model: what it is, what it was asked for, and what it measured."""

    method: str
    mode: Mode
    family: Family
    description: str = ""
    peer: str | None = None
    """For ours: the peer whose measured peak is this row's budget."""
    solver: str | None = None
    budget_bytes: int | None = None
    planned_budget_bytes: int | None = None
    """For ours: the budget `optimize` got (NOTE [compiled budgets]); the row is judged by `budget_bytes`."""
    budget_fraction: float | None = None
    peak_bytes: int | None = None
    kept_after_forward_bytes: int | None = None
    within_budget: bool | None = None
    step_ms: float | None = None
    time_ratio_vs_none: float | None = None
    """Median over the interleaved rounds of `round_ratios_vs_none`."""
    round_ratios_vs_none: list[float] = field(default_factory=list)
    """Per round: this row's step time over no checkpointing's in the same round."""
    gradients_equal: bool | None = None
    gradient_error: float | None = None
    """||gradients - reference|| / ||reference|| over the whole model (bench/peers.py `gradient_error`)."""
    gradient_mismatch: str | None = None
    buffers_equal: bool | None = None
    predicted_peak_bytes: int | None = None
    checkpointed_regions: int | None = None
    infeasible_min_peak_bytes: int | None = None
    same_plan_as: str | None = None
    ran_compiled: bool | None = None
    not_applicable: str | None = None
    error: str | None = None


@dataclass
class TrackerCheck:
    """What the live-storage tracker and the CPU allocator's events count for one model's steps."""

    eager_tracker_peak_bytes: int
    eager_allocator_peak_bytes: int
    compiled_allocator_peak_bytes: int | None
    compiled_tracker_peak_bytes: int
    ran_compiled_after_tracker: bool


@dataclass
class ModelResult:
    name: str
    device: str
    capture: str | None = None
    predicted_min_peak_bytes: int | None = None
    predicted_baseline_peak_bytes: int | None = None
    rows: list[Row] = field(default_factory=list)
    tracker_check: TrackerCheck | None = None
    seconds: float | None = None
    error: str | None = None


def peak_source(device: str, mode: Mode) -> str:
    if device.startswith("cuda"):
        return "CUDA caching allocator (max_memory_allocated)"
    if mode is Mode.COMPILED:
        return "CPU allocator events (torch.profiler, profile_memory=True) + parameters, buffers, inputs"
    return "live tensor storages (planner.measure)"


def label(row: Row) -> str:
    """A row's name in tables: "sqrt(n) segments", "compile budget 0.5", "ours dp @ every block"."""
    if row.family is Family.OURS:
        return f"ours {row.solver} @ {row.peer}"
    return row.method


def row_from_dict(data: dict[str, Any]) -> Row:
    return Row(**{**data, "mode": Mode(data["mode"]), "family": Family(data["family"])})


def result_from_dict(data: dict[str, Any]) -> ModelResult:
    check = data.get("tracker_check")
    return replace(
        ModelResult(**{key: value for key, value in data.items() if key not in ("rows", "tracker_check")}),
        rows=[row_from_dict(row) for row in data.get("rows", [])],
        tracker_check=TrackerCheck(**check) if check else None,
    )


def peer_of(row: Row, rows: Sequence[Row]) -> Row | None:
    """The peer row whose measured peak was `row`'s budget."""
    return next((peer for peer in rows if peer.mode is row.mode and label(peer) == row.peer), None)


def ratios_vs_peer(row: Row, rows: Sequence[Row]) -> list[float]:
    """Per round: our step time over the peer's (one round runs both, so drift between rounds cancels)."""
    peer = peer_of(row, rows)
    if peer is None or len(peer.round_ratios_vs_none) != len(row.round_ratios_vs_none):
        return []
    return [
        ours / theirs
        for ours, theirs in zip(row.round_ratios_vs_none, peer.round_ratios_vs_none, strict=True)
    ]


def time_vs_peer(row: Row, rows: Sequence[Row]) -> float | None:
    """Our step time over the peer's: the median over rounds of the per-round ratio, or (rounds not
    paired) the ratio of the two medians against no checkpointing."""
    ratios = ratios_vs_peer(row, rows)
    if ratios:
        return statistics.median(ratios)
    peer = peer_of(row, rows)
    if peer is None or row.time_ratio_vs_none is None or peer.time_ratio_vs_none is None:
        return None
    return row.time_ratio_vs_none / peer.time_ratio_vs_none


def measurably_slower(row: Row, rows: Sequence[Row]) -> bool:
    """Whether our step time is above the peer's beyond the timing noise: the median ratio's 95 %
    interval lies above 1 (NOTE [timing noise] in bench/peers.py); with too few rounds for an interval,
    a median above 1."""
    ratios = ratios_vs_peer(row, rows)
    interval = median_interval(ratios) if ratios else None
    if interval is not None:
        return interval[0] > 1.0
    ratio = time_vs_peer(row, rows)
    return ratio is not None and ratio > 1.0


def matches_peer(row: Row, rows: Sequence[Row]) -> bool | None:
    """Done-when of issues 7 and 14: our measured peak within the peer's, and our step time not
    measurably above its (`measurably_slower`); a plan that trains otherwise than the model
    (`trains_otherwise`) matches nothing."""
    if row.within_budget is None or time_vs_peer(row, rows) is None:
        return None
    return not trains_otherwise(row) and row.within_budget and not measurably_slower(row, rows)


def trains_otherwise(row: Row) -> bool:
    """Whether one step of `row` gave other gradients, or other buffers (BatchNorm statistics updated
    twice by a replay), than the unmodified model's step under the same seed."""
    return row.gradients_equal is False or row.buffers_equal is False


def spread_text(row: Row, rows: Sequence[Row]) -> str:
    """The median ratio's 95 % interval over the rounds, so a median above 1 can be told from noise."""
    ratios = ratios_vs_peer(row, rows)
    if not ratios:
        return ""
    interval = median_interval(ratios)
    if interval is None:
        return f"rounds {min(ratios):.2f}-{max(ratios):.2f}"
    return f"95 % interval {interval[0]:.3f}-{interval[1]:.3f} over {len(ratios)} rounds"


def budget_cell(row: Row) -> str:
    if row.budget_fraction is not None and row.family is Family.PEER:
        return f"fraction {row.budget_fraction:g}"
    return mib(row.budget_bytes) if row.budget_bytes is not None else "—"


def peak_cell(row: Row) -> str:
    text = mib(row.peak_bytes)
    if row.ran_compiled is False:
        text += " (ran eagerly)"
    return text


def gradient_cell(row: Row) -> str:
    text = yes_no(row.gradients_equal)
    if row.gradients_equal is False and row.gradient_error is not None:
        text += f" (error {row.gradient_error:.1e})"
    if row.buffers_equal is False:
        text += " (buffers differ)"
    return text


def ours_cell(row: Row, rows: Sequence[Row]) -> str:
    if row.family is not Family.OURS:
        return ""
    notes = [
        f"{fmt(time_vs_peer(row, rows), '.3f')}x peer's time ({spread_text(row, rows)})",
        f"matches peer: {yes_no(matches_peer(row, rows))}",
    ]
    if row.infeasible_min_peak_bytes is not None:
        notes.append(f"budget below our predicted min {mib(row.infeasible_min_peak_bytes)}: planned at min")
    if row.same_plan_as:
        notes.append(f"same plan as {row.same_plan_as}")
    return "; ".join(notes)


def table_line(model: str, row: Row, rows: Sequence[Row]) -> str:
    if row.not_applicable or row.error:
        reason = f"not applicable: {row.not_applicable}" if row.not_applicable else f"error: {row.error}"
        reason = reason if len(reason) <= REASON_CHARACTERS else reason[: REASON_CHARACTERS - 1] + "…"
        return f"| {model} | {label(row)} | {reason} | | | | | |"
    return (
        f"| {model} | {label(row)} | {budget_cell(row)} | {peak_cell(row)} | {yes_no(row.within_budget)} | "
        f"{fmt(row.time_ratio_vs_none, '.3f')} | {gradient_cell(row)} | {ours_cell(row, rows)} |"
    )


def mode_table(results: Sequence[ModelResult], mode: Mode) -> list[str]:
    lines = [
        "| model | row | budget (MiB) | measured peak (MiB) | within budget | step time vs none | "
        "grads equal | ours against its peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if result.error:
            lines.append(f"| {result.name} | error: {result.error} | | | | | | |")
            continue
        rows = [row for row in result.rows if row.mode is mode]
        lines += [table_line(result.name, row, rows) for row in rows]
    return lines


def misses(results: Sequence[ModelResult]) -> list[str]:
    """One line per place where ours does not reach a peer's budget at no more step time, and other faults."""
    lines = []
    for result in results:
        for row in result.rows:
            where = f"{result.name} ({row.mode}) {label(row)}"
            if row.family is Family.OURS and matches_peer(row, result.rows) is False:
                lines.append(
                    f"- {where}: peak {mib(row.peak_bytes)} MiB against budget {mib(row.budget_bytes)} MiB, "
                    f"step time {fmt(time_vs_peer(row, result.rows), '.3f')}x the peer's "
                    f"({spread_text(row, result.rows)})"
                )
            if row.gradients_equal is False:
                lines.append(
                    f"- {where}: gradients differ from {REFERENCES[row.mode]}: {row.gradient_mismatch}"
                )
            if row.ran_compiled is False:
                lines.append(f"- {where}: dynamo ran the step eagerly; its figures are not compiled ones")
            if row.error:
                lines.append(f"- {where}: {row.error}")
    return lines or ["- none"]


def predictions(results: Sequence[ModelResult]) -> list[str]:
    """Per mode, how our rows' predicted peaks compare with their measurements; every miss named."""
    lines = ["| mode | our rows measured | within 2 % | upper bound | low |", "|---|---|---|---|---|"]
    missed: list[str] = []
    for mode in Mode:
        ours = [
            (result.name, row)
            for result in results
            for row in result.rows
            if row.mode is mode and row.family is Family.OURS and row.peak_bytes and row.predicted_peak_bytes
        ]
        verdicts = [(name, row, verdict(row.predicted_peak_bytes, row.peak_bytes)) for name, row in ours]
        counts = [
            sum(text.startswith(kind) for *_, text in verdicts) for kind in ("within", "upper", "**low")
        ]
        lines.append(f"| {mode} | {len(ours)} | {counts[0]} | {counts[1]} | {counts[2]} |")
        missed += [
            f"- {name}, {label(row)}: {text}" for name, row, text in verdicts if not text.startswith("within")
        ]
    return [*lines, "", *missed]


def tracker_table(results: Sequence[ModelResult]) -> list[str]:
    lines = [
        "| model | eager: tracker MiB | eager: allocator MiB | compiled: allocator MiB | "
        "compiled: tracker MiB | compiled code ran after the tracker |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        check = result.tracker_check
        if check is not None:
            lines.append(
                f"| {result.name} | {mib(check.eager_tracker_peak_bytes)} | "
                f"{mib(check.eager_allocator_peak_bytes)} | {mib(check.compiled_allocator_peak_bytes)} | "
                f"{mib(check.compiled_tracker_peak_bytes)} | {yes_no(check.ran_compiled_after_tracker)} |"
            )
    return lines


def measured_peers(rows: Sequence[Row]) -> list[Row]:
    """The peers among `rows` with a measured peak: each is one comparison per solver."""
    return [row for row in rows if row.family is Family.PEER and row.peak_bytes is not None]


def ours_against(peer: Row, rows: Sequence[Row], solver: str) -> Row | None:
    return next(
        (
            row
            for row in rows
            if row.family is Family.OURS and row.solver == solver and row.peer == label(peer)
        ),
        None,
    )


def peak_and_time(row: Row | None) -> str:
    if row is None or row.peak_bytes is None:
        return "—"
    return f"{mib(row.peak_bytes)} / {fmt(row.time_ratio_vs_none, '.2f')}"


def verdict_cell(peer: Row, rows: Sequence[Row]) -> str:
    """Per solver: does our row reach the peer's peak at no more step time (`matches_peer`)?"""
    verdicts = []
    for solver in SOLVERS:
        ours = ours_against(peer, rows, solver)
        if ours is not None:
            verdicts.append(f"{solver} {yes_no(matches_peer(ours, rows))}")
    return ", ".join(verdicts) or "—"


def summary_table(results: Sequence[ModelResult]) -> list[str]:
    """One line per model, mode and peer: the peer's peak and time against ours at that peak."""
    lines = [
        "| model | mode | peer | peer: peak MiB / time | ours dp: peak MiB / time | "
        "ours ilp: peak MiB / time | ours within the peer's peak and not measurably slower |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for peer in measured_peers(result.rows):
            rows = [row for row in result.rows if row.mode is peer.mode]
            lines.append(
                f"| {result.name} | {peer.mode} | {label(peer)} | {peak_and_time(peer)} | "
                f"{peak_and_time(ours_against(peer, rows, 'dp'))} | "
                f"{peak_and_time(ours_against(peer, rows, 'ilp'))} | {verdict_cell(peer, rows)} |"
            )
    return lines


@dataclass
class Tally:
    """How one solver's rows of one mode fared against their peers (each peer with a measured peak is
    one comparison); a miss is counted once, by its first reason in this order."""

    comparisons: int = 0
    matched: int = 0
    """Within the peer's peak and not measurably slower (`matches_peer`)."""
    matched_by_median: int = 0
    """Of `matched`, those whose median ratio to the peer is at most 1 as well."""
    no_plan: int = 0
    """Ours has no measured row (planning refused or failed)."""
    ours_trains_otherwise: int = 0
    """Ours trains with other loss, gradients or buffers than the unmodified model (`trains_otherwise`)."""
    over_peak: int = 0
    slower: int = 0
    """Measurably slower: the median ratio's 95 % interval lies above 1."""
    misses_against_other_training: int = 0
    """Misses where the peer itself trains otherwise than the model (`trains_otherwise`): its gradients
    were wrong (NOTE [compiled gradients] in bench/compare_measurement.py) or its replay updated
    BatchNorm statistics twice."""


def tally(results: Sequence[ModelResult], mode: Mode, solver: str) -> Tally:
    """Count `solver`'s comparisons in `mode` and why the misses missed."""
    counts = Tally()
    for result in results:
        rows = [row for row in result.rows if row.mode is mode]
        for peer in measured_peers(rows):
            counts.comparisons += 1
            ours = ours_against(peer, rows, solver)
            matched = matches_peer(ours, rows) if ours is not None and ours.peak_bytes is not None else None
            if matched:
                assert ours is not None
                counts.matched += 1
                counts.matched_by_median += (time_vs_peer(ours, rows) or 0.0) <= 1.0
                continue
            counts.misses_against_other_training += trains_otherwise(peer)
            if matched is None or ours is None:
                counts.no_plan += 1
            elif trains_otherwise(ours):
                counts.ours_trains_otherwise += 1
            elif not ours.within_budget:
                counts.over_peak += 1
            else:
                counts.slower += 1
    return counts


def tally_table(results: Sequence[ModelResult]) -> list[str]:
    """Per mode and solver: comparisons matched, and the misses by reason."""
    lines = [
        "| mode | solver | within the peer's peak and not measurably slower | of which no slower by the "
        "median | no plan | ours trains otherwise | over the peak | measurably slower | misses whose "
        "peer trains otherwise |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in Mode:
        for solver in SOLVERS:
            counts = tally(results, mode, solver)
            if counts.comparisons:
                lines.append(
                    f"| {mode} | {solver} | {counts.matched} of {counts.comparisons} | "
                    f"{counts.matched_by_median} | {counts.no_plan} | {counts.ours_trains_otherwise} | "
                    f"{counts.over_peak} | {counts.slower} | "
                    f"{counts.misses_against_other_training} |"
                )
    return lines


def timing_text(context: dict[str, Any]) -> str:
    """How many timing rounds the run asked for (older results: a fixed count)."""
    timing_s = context.get("timing_s")
    if not timing_s:
        return f"{context['rounds']} interleaved timing rounds"
    return (
        f"interleaved timing rounds per model and mode: at least {context['rounds']}, as many as fit "
        f"{timing_s:g} s"
    )


def markdown(results: Sequence[ModelResult], context: dict[str, Any]) -> str:
    device = context["device"]
    load = ", ".join(f"{value:.1f}" for value in context["machine"]["load_average_1_5_15_min"])
    header = [
        f"# Side-by-side benchmark on {device} ({'quick' if context['quick'] else 'full'} run)",
        "",
        f"{context['machine']['processor']}, {context['machine']['cpu_count']} CPUs, torch "
        f"{context['machine']['torch_version']}; load average at start {load} (1/5/15 min); "
        f"{timing_text(context)}; {context['total_s'] / 60:.1f} minutes. "
        f"Command: `{' '.join(context['command'])}`",
        "",
        "Ours is planned with the peer's measured peak as its budget. Step time vs none: median over rounds "
        "of the step-time ratio to no checkpointing in the same mode. Grads equal: loss, gradients and "
        "buffers after one step vs the unmodified model (same seed, dropout included): eager rows vs the "
        "eager model, compiled rows vs compiled no checkpointing (inductor draws its own dropout masks).",
        "",
    ]
    sections = [
        "## Summary: each peer against our plans at its measured peak",
        "",
        "Time: step time over no checkpointing in the same mode (median of interleaved rounds).",
        "",
        *summary_table(results),
        "",
        "## Tally",
        "",
        "Each peer with a measured peak is one comparison per solver; a miss counts once, by its first "
        "reason from the left. Not measurably slower: the 95 % interval of the median of our per-round "
        "step-time ratio to the peer's reaches 1 or below (the tables below give each interval); the "
        "second column counts those whose median is at most 1 as well.",
        "",
        *tally_table(results),
        "",
    ]
    sections += [
        "## Our predicted peaks against their measurements",
        "",
        "Each of our rows: the planner's predicted peak against the row's measured peak in its mode's "
        "currency (bench/prediction_verdicts.py).",
        "",
        *predictions(results),
        "",
    ]
    for mode in Mode:
        sections += [
            f"## {device}, {mode}: peaks are {peak_source(device, mode)}",
            "",
            *mode_table(results, mode),
            "",
        ]
    footer = ["## Where ours does not match its peer, and other faults", "", *misses(results), ""]
    if any(result.tracker_check for result in results):
        footer += [
            "## The live-storage tracker on compiled steps",
            "",
            "Dynamo runs no compiled code under a TorchDispatchMode, so the tracker reports a compiled "
            "module's eager peak (and the module runs eagerly from then on): compiled rows count allocator "
            "events instead.",
            "",
            *tracker_table(results),
            "",
        ]
    return "\n".join(header + sections + footer)
