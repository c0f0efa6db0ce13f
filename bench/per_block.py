"""Our plans against the hand method on every zoo model: `checkpoint_wrapper` on every instance of a type.

Why it exists: users checkpoint by hand with one line per block type, and a planner is only worth using
if it never claims "impossible" where that line works and is no slower at the same memory. For every zoo
model (the user-report zoo and the real-model zoo, DAG-shaped models included) this script records:

- the measured peak without checkpointing and with every instance of each repeated, hook-free module
  type checkpointed (non-reentrant `checkpoint_wrapper`; planner/testing/zoo_dag.py), and which of those types
  gives the lowest peak (the best hand method);
- the planner's lowest achievable peak (`plan.min_peak_bytes`, predicted) and whether it is at or below
  every hand method's measured peak;
- our plan at the best hand method's measured peak (`solver="auto"`): its predicted and measured peak
  and whether it fits, and its step time against the hand method's, as the median of per-round ratios
  over interleaved rounds (with the range of the rounds: the CPU is noisy).

Models planned by submodules (capture "module") are measured as every other model. Run from the
repository root (about 4 min on 2 CPU cores); with `--models`, the named models' rows replace theirs in
the existing results and the other rows are kept:

    .venv/bin/python -m bench.per_block [--models unet_deep,vit_torch_encoder] [--rounds 7]

Writes `bench/results/per_block.json` and `bench/results/per_block.md`; docs/plan-space.md quotes the rows of
the DAG-shaped models by hand.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import planner
from bench.peers import contender, interleaved_step_ms, machine, mib, paired_ratio, planner_revision
from planner.errors import InfeasibleBudget
from planner.testing.hand_methods import checkpoint_every_instance, hook_free_types
from planner.testing.zoo_real import REAL_ZOO, ExampleCall, build_call
from planner.zoo import FIDELITY_ZOO, build_model

log = logging.getLogger("bench.per_block")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
REFERENCE_BUDGET_BYTES = 2**40


def example_call(name: str) -> ExampleCall:
    if name in REAL_ZOO:
        return build_call(name)
    model, inputs = build_model(name)
    return ExampleCall(model, inputs)


def hand_variants(call: ExampleCall) -> dict[str, Any]:
    """Per repeated, hook-free module type: the model with every instance checkpointed by hand."""
    return {
        kind.__name__: checkpoint_every_instance(call.model, kind) for kind in hook_free_types(call.model)
    }


def model_row(name: str, rounds: int) -> dict[str, Any]:
    call = example_call(name)
    row: dict[str, Any] = {"model": name}
    variants = hand_variants(call)
    if not variants:
        row["skipped"] = "no module type with two or more hook-free instances"
        return row
    baseline = planner.measure(copy.deepcopy(call.model), call.args, example_kwargs=call.kwargs)
    hand = {
        kind: planner.measure(copy.deepcopy(module), call.args, example_kwargs=call.kwargs).peak_bytes
        for kind, module in variants.items()
    }
    best_kind = min(hand, key=hand.__getitem__)
    started = time.perf_counter()
    reference = planner.optimize(
        call.model, call.args, example_kwargs=call.kwargs, budget_bytes=REFERENCE_BUDGET_BYTES
    )
    try:
        plan = reference.replan(budget_bytes=hand[best_kind])
    except InfeasibleBudget:
        # Our lowest predicted peak is above the hand method's measured one: plan there and measure it.
        row["planned_at_lowest"] = True
        plan = reference.replan(budget_bytes=reference.min_peak_bytes)
    planning_s = time.perf_counter() - started
    measured = planner.measure(copy.deepcopy(plan.module), call.args, example_kwargs=call.kwargs)
    ours = contender("ours", plan.module, call.args, kwargs=call.kwargs)
    theirs = contender(best_kind, variants[best_kind], call.args, kwargs=call.kwargs)
    interleaved_step_ms([ours, theirs], rounds=rounds)
    ratios = [a / b for a, b in zip(ours.step_ms, theirs.step_ms, strict=True)]
    row.update(
        capture=plan.capture,
        baseline_peak_bytes=baseline.peak_bytes,
        hand_peak_bytes=hand,
        best_hand=best_kind,
        min_peak_bytes=reference.min_peak_bytes,
        min_at_or_below_every_hand=all(reference.min_peak_bytes <= peak for peak in hand.values()),
        budget_bytes=hand[best_kind],
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=measured.peak_bytes,
        fits=measured.peak_bytes <= hand[best_kind],
        regions=len(plan.schedule.checkpointed),
        planning_s=round(planning_s, 2),
        step_time_ratio=round(paired_ratio(ours, theirs), 3),
        step_time_ratio_rounds=[round(min(ratios), 3), round(max(ratios), 3)],
    )
    return row


AT_LOWEST = " (no plan at the hand peak: planned at our lowest)"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | capture | no checkpointing | best hand method (type: measured) | our lowest peak "
        "(predicted) | at or below every hand method | ours at the hand peak: predicted / measured | "
        "fits | step time ours / hand (rounds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['model']} | — | — | {row['skipped']} | — | — | — | — | — |")
            continue
        low, high = row["step_time_ratio_rounds"]
        lines.append(
            f"| {row['model']} | {row['capture']} | {mib(row['baseline_peak_bytes'])} | "
            f"{row['best_hand']}: {mib(row['budget_bytes'])} | {mib(row['min_peak_bytes'])} | "
            f"{'yes' if row['min_at_or_below_every_hand'] else '**no**'} | "
            f"{mib(row['predicted_peak_bytes'])} / {mib(row['measured_peak_bytes'])}"
            f"{AT_LOWEST if row.get('planned_at_lowest') else ''} | "
            f"{'yes' if row['fits'] else '**no**'} | {row['step_time_ratio']:.2f} ({low:.2f}-{high:.2f}) |"
        )
    note = "Peaks in MiB, measured on the CPU with live-storage counting (two Adam steps)."
    return "\n".join(lines) + f"\n\n{note}\n"


def _replace_rows(kept: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`kept` (an earlier run's rows, in its order) with the rows of `new`'s models replaced; models
    `kept` does not have are added at the end."""
    by_model = {row["model"]: row for row in new}
    merged = [by_model.pop(row["model"], row) for row in kept]
    return merged + list(by_model.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated zoo names (default: every model)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS_DIRECTORY / "per_block.json"))
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = arguments.models.split(",") if arguments.models else [*FIDELITY_ZOO, *REAL_ZOO]
    revision = planner_revision()
    rows = []
    for name in names:
        # Each row names the commit it was measured at: a run with --models keeps other runs' rows.
        rows.append({**model_row(name, arguments.rounds), "revision": revision["commit"]})
        log.info("%s: %s", name, rows[-1])
    out = Path(arguments.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if arguments.models and out.exists():
        rows = _replace_rows(json.loads(out.read_text())["rows"], rows)
    record = {"machine": machine(), "revision": revision, "rows": rows}
    out.write_text(json.dumps(record, indent=2) + "\n")
    table = markdown(rows)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
