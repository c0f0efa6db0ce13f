"""Fidelity benchmark: does a plan fit its budget, predict its own peak, and beat hand-written checkpointing?

Why it exists: the planner's promise is quantitative (measured peak <= budget, predicted peak within 5 % of
measured, `optimize()` in seconds, and no slower than what users write by hand at the same memory). This
script measures each of those on every model of `planner.zoo.FIDELITY_ZOO`, in one run, and reports them
as they are; it asserts nothing, so a missed target shows up as a row, not as a crash.

Per model it records:

1. the wall time of `planner.optimize` at a mid budget, and the plan's facts;
2. a budget sweep between the predicted lowest peak and the predicted no-checkpointing peak: the
   predicted and measured peak at each budget, the relative error and whether the measurement fits;
3. two hand-written peers, each on a deep copy of the model: "sqrt(n) segments" (what
   `torch.utils.checkpoint.checkpoint_sequential` does) and "every block" (what
   `gradient_checkpointing_enable` does, via `checkpoint_wrapper`). Each peer's loss, gradients and
   buffers are compared with the unmodified model's; then our plan is made with the peer's measured peak
   as its budget, and the two (plus the unmodified model) are timed in interleaved training steps.

Peak bytes come from `planner.measure` (two real Adam training steps, live tensor storages on the CPU,
`max_memory_allocated` on a GPU). Step times are medians over interleaved rounds, each round running one
step of every variant in a rotating order, so that drift in the machine's speed hits all variants alike.

Run from the repository root:

    .venv/bin/python -m bench.fidelity                      # everything: 2.3 minutes on an idle 2-core CPU
    .venv/bin/python -m bench.fidelity --quick              # 3 budgets, 3 timing rounds
    .venv/bin/python -m bench.fidelity --models gpt_tiny,seed000_mlp --out /tmp/fidelity.json

Results: JSON at `--out` (default `bench/results/fidelity.json`, or `fidelity_quick.json` with `--quick`)
and the markdown tables beside it (same name, `.md`, written by fidelity_report.py), also printed to
stdout. Progress goes to stderr. docs/results.md (Fidelity) summarises them by hand: update it after a run.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

import planner
from bench.fidelity_report import (
    ModelReport,
    PeerComparison,
    SolverLadder,
    StepTiming,
    SweepPoint,
    markdown,
)
from bench.peers import (
    GRADIENT_RTOL,
    MIB,
    contender,
    fmt,
    interleaved_step_ms,
    machine,
    mib,
    paired_ratio,
    planner_revision,
)
from planner import zoo
from planner.testing.hand_methods import EVERY_BLOCK, HandMethod, every_block, sqrt_segments
from planner.testing.steps import (
    StepRecord,
    Variant,
    buffer_mismatch,
    fresh_inputs,
    gradient_mismatch,
    one_step,
    variant_of,
)

log = logging.getLogger("bench.fidelity")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
REFERENCE_BUDGET_BYTES = 2**40
"""A budget every plan fits: its plan reports the predicted lowest and no-checkpointing peaks."""
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.9)
QUICK_FRACTIONS = (0.1, 0.5, 0.9)
MID_FRACTION = 0.5
"""Budget fraction whose `optimize()` call is the reported wall time (in both fraction lists)."""
TIMING_ROUNDS = 7
QUICK_TIMING_ROUNDS = 3


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def same_state(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)


def measured_peak_bytes(module: nn.Module, inputs: Sequence[Any]) -> int:
    """Peak of two real training steps of a deep copy (measuring trains the model it is given)."""
    return planner.measure(copy.deepcopy(module), fresh_inputs(inputs)).peak_bytes


def timed_optimize(model: nn.Module, inputs: Sequence[Any], budget_bytes: int) -> tuple[planner.Plan, float]:
    started_s = time.perf_counter()
    plan = planner.optimize(model, inputs, budget_bytes=budget_bytes)
    return plan, time.perf_counter() - started_s


def budget_at(lowest_bytes: int, baseline_bytes: int, fraction: float) -> int:
    return int(lowest_bytes + fraction * (baseline_bytes - lowest_bytes))


def time_against_peer(
    ours: nn.Module | None, peer: nn.Module, unmodified: nn.Module, inputs: Sequence[Any], *, rounds: int
) -> StepTiming:
    peer_runner = contender("peer", peer, inputs)
    none_runner = contender("none", unmodified, inputs)
    ours_runner = contender("ours", ours, inputs) if ours is not None else None
    runners = [r for r in (ours_runner, peer_runner, none_runner) if r is not None]
    interleaved_step_ms(runners, rounds=rounds)
    return StepTiming(
        rounds=rounds,
        ours_step_ms=statistics.median(ours_runner.step_ms) if ours_runner else None,
        peer_step_ms=statistics.median(peer_runner.step_ms),
        none_step_ms=statistics.median(none_runner.step_ms),
        ratio_ours_to_peer=paired_ratio(ours_runner, peer_runner) if ours_runner else None,
        peer_overhead_vs_none=paired_ratio(peer_runner, none_runner) - 1.0,
        ours_overhead_vs_none=paired_ratio(ours_runner, none_runner) - 1.0 if ours_runner else None,
    )


def compare_with_peer(
    method: HandMethod,
    model: nn.Module,
    inputs: Sequence[Any],
    reference: StepRecord,
    *,
    rounds: int,
) -> PeerComparison:
    name, peer, description = method.name, method.variant, method.description
    if peer is None:
        log.info("  %s: not applicable: %s", name, description)
        return PeerComparison(peer=name, description="", not_applicable=description)
    result = PeerComparison(peer=name, description=description)
    peer_step = one_step(peer, inputs)
    result.gradient_mismatch = gradient_mismatch(reference, peer_step, rtol=GRADIENT_RTOL)
    result.gradients_equal = result.gradient_mismatch is None
    result.buffer_mismatch = buffer_mismatch(reference, peer_step)
    result.buffers_equal = result.buffer_mismatch is None
    result.peer_measured_peak_bytes = measured_peak_bytes(peer.module, inputs)
    result.ours_budget_bytes = result.peer_measured_peak_bytes
    source = variant_of(copy.deepcopy(model))
    try:
        plan, _ = timed_optimize(source.module, inputs, result.ours_budget_bytes)
    except planner.InfeasibleBudget as error:
        # NOTE [infeasible at the peer's peak]: the comparison row stays "infeasible"; we still plan at
        # the lowest budget the planner accepts, because its *measured* peak may reach the peer's.
        result.ours_infeasible_min_peak_bytes = error.min_peak_bytes
        result.ours_budget_bytes = error.min_peak_bytes
        plan, _ = timed_optimize(source.module, inputs, error.min_peak_bytes)
    assert plan.module is not None
    ours = plan.module
    result.ours_predicted_peak_bytes = plan.predicted_peak_bytes
    result.ours_checkpointed_regions = len(plan.regions)
    result.ours_measured_peak_bytes = measured_peak_bytes(ours, inputs)
    result.ours_not_above_peer = result.ours_measured_peak_bytes <= result.peer_measured_peak_bytes
    ours_step = one_step(Variant(ours, source.parameters, source.buffers), inputs)
    result.ours_gradients_equal = gradient_mismatch(reference, ours_step, rtol=GRADIENT_RTOL) is None
    result.ours_buffers_equal = buffer_mismatch(reference, ours_step) is None
    result.timing = time_against_peer(ours, peer.module, model, inputs, rounds=rounds)
    log.info(
        "  %s: peer %.2f MiB, ours %s, step ratio ours/peer %s",
        name,
        result.peer_measured_peak_bytes / MIB,
        mib(result.ours_measured_peak_bytes),
        fmt(result.timing.ratio_ours_to_peer, ".3f"),
    )
    return result


def solver_ladder(
    method: HandMethod,
    model: nn.Module,
    inputs: Sequence[Any],
    reference: StepRecord,
    *,
    rounds: int,
) -> SolverLadder:
    peer, description = method.variant, method.description
    if peer is None:
        return SolverLadder(not_applicable=description)
    ladder = SolverLadder(budget_bytes=measured_peak_bytes(peer.module, inputs))
    modules: dict[str, nn.Module] = {}
    schedules = {}
    source = variant_of(copy.deepcopy(model))
    try:
        dp_plan = planner.optimize(source.module, inputs, budget_bytes=ladder.budget_bytes, solver="dp")
    except planner.InfeasibleBudget as error:
        ladder.not_applicable = f"no plan at the peer's peak (predicted min {mib(error.min_peak_bytes)} MiB)"
        return ladder
    # Both solvers on one profile: measured node times differ between profiling runs.
    plans = {"dp": dp_plan, "ilp": dp_plan.replan(budget_bytes=ladder.budget_bytes, solver="ilp")}
    for solver, plan in plans.items():
        assert plan.module is not None
        modules[solver] = plan.module
        schedules[solver] = plan.schedule.regions
        ladder.measured_peak_bytes[solver] = measured_peak_bytes(plan.module, inputs)
        ladder.predicted_recompute_ms[solver] = plan.simulation.recompute_ms
        ladder.keeps[solver] = sum(len(region.keep) for region in plan.schedule.regions)
        step = one_step(Variant(plan.module, source.parameters, source.buffers), inputs)
        ladder.gradients_equal[solver] = gradient_mismatch(reference, step, rtol=GRADIENT_RTOL) is None
    ladder.same_plan = schedules["dp"] == schedules["ilp"]
    if ladder.same_plan:
        del modules["ilp"]
    runners = [contender(solver, module, inputs) for solver, module in modules.items()]
    runners.append(contender(EVERY_BLOCK, peer.module, inputs))
    unmodified = contender("none", model, inputs)
    interleaved_step_ms([*runners, unmodified], rounds=rounds)
    ladder.overhead_vs_none = {runner.name: paired_ratio(runner, unmodified) - 1.0 for runner in runners}
    if ladder.same_plan:
        ladder.overhead_vs_none["ilp"] = ladder.overhead_vs_none["dp"]
    log.info("  solver ladder at %s MiB: %s", mib(ladder.budget_bytes), ladder.overhead_vs_none)
    return ladder


def sweep_point(model: nn.Module, inputs: Sequence[Any], *, fraction: float, budget_bytes: int) -> SweepPoint:
    before = state_of(model)
    started_s = time.perf_counter()
    try:
        plan, optimize_s = timed_optimize(model, inputs, budget_bytes)
    except planner.InfeasibleBudget as error:
        return SweepPoint(
            fraction=fraction,
            budget_bytes=budget_bytes,
            optimize_s=time.perf_counter() - started_s,
            model_unchanged_by_optimize=same_state(before, state_of(model)),
            infeasible_min_peak_bytes=error.min_peak_bytes,
        )
    assert plan.module is not None
    measured = measured_peak_bytes(plan.module, inputs)
    point = SweepPoint(
        fraction=fraction,
        budget_bytes=budget_bytes,
        optimize_s=optimize_s,
        model_unchanged_by_optimize=same_state(before, state_of(model)),
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=measured,
        relative_error=(plan.predicted_peak_bytes - measured) / measured,
        fits=measured <= budget_bytes,
        predicted_overhead=plan.predicted_overhead,
        checkpointed_regions=len(plan.regions),
        solver=plan.solver,
    )
    log.info(
        "  f=%.2f budget %.2f MiB: predicted %.2f, measured %.2f MiB (%+.2f %%), %d regions, optimize %.2f s",
        fraction,
        budget_bytes / MIB,
        plan.predicted_peak_bytes / MIB,
        measured / MIB,
        100 * (plan.predicted_peak_bytes - measured) / measured,
        len(plan.regions),
        optimize_s,
    )
    return point


def benchmark_model(name: str, *, fractions: Sequence[float], rounds: int) -> ModelReport:
    report = ModelReport(name=name)
    model, inputs = zoo.build_model(name)
    log.info("%s: reference plan", name)
    reference_plan, report.first_optimize_s = timed_optimize(
        copy.deepcopy(model), inputs, REFERENCE_BUDGET_BYTES
    )
    lowest, baseline = reference_plan.min_peak_bytes, reference_plan.baseline_peak_bytes
    report.lowest_predicted_peak_bytes, report.baseline_predicted_peak_bytes = lowest, baseline
    report.capture, report.solver = reference_plan.capture, reference_plan.solver
    report.baseline_measured_peak_bytes = measured_peak_bytes(model, inputs)

    for fraction in fractions:
        budget = budget_at(lowest, baseline, fraction)
        report.sweep.append(sweep_point(copy.deepcopy(model), inputs, fraction=fraction, budget_bytes=budget))
    report.model_unchanged_by_optimize = all(point.model_unchanged_by_optimize for point in report.sweep)
    mid = next(point for point in report.sweep if point.fraction == MID_FRACTION)
    report.optimize_s, report.optimize_budget_bytes = mid.optimize_s, mid.budget_bytes
    report.mid_checkpointed_regions = mid.checkpointed_regions

    reference_step = one_step(variant_of(model), inputs)
    for method in (sqrt_segments(model, inputs), every_block(model)):
        report.peers.append(compare_with_peer(method, model, inputs, reference_step, rounds=rounds))
    report.ladder = solver_ladder(every_block(model), model, inputs, reference_step, rounds=rounds)
    return report


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(zoo.FIDELITY_ZOO)}")
    parser.add_argument("--quick", action="store_true", help="3 budgets and 3 timing rounds per model")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/fidelity[_quick].json)")
    arguments = parser.parse_args(argv)
    names = arguments.models.split(",") if arguments.models else list(zoo.FIDELITY_ZOO)
    unknown = [name for name in names if name not in zoo.FIDELITY_ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(zoo.FIDELITY_ZOO)}")
    arguments.models = names
    if arguments.out is None:
        arguments.out = RESULTS_DIRECTORY / ("fidelity_quick.json" if arguments.quick else "fidelity.json")
    return arguments


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("planner").setLevel(logging.WARNING)
    arguments = parse_arguments(argv)
    fractions = QUICK_FRACTIONS if arguments.quick else FRACTIONS
    rounds = QUICK_TIMING_ROUNDS if arguments.quick else TIMING_ROUNDS
    started_s = time.perf_counter()
    # Other processes on the machine skew step times; the load before and after says how much.
    machine_before = machine()
    revision = planner_revision()  # before the lazily imported planner modules load
    reports = []
    for name in arguments.models:
        model_started_s = time.perf_counter()
        try:
            reports.append(benchmark_model(name, fractions=fractions, rounds=rounds))
        except Exception as error:  # one model's failure must not lose the others' results
            log.exception("%s failed", name)
            reports.append(ModelReport(name=name, error=f"{type(error).__name__}: {error}".splitlines()[0]))
        log.info("%s done in %.1f s", name, time.perf_counter() - model_started_s)
    total_s = time.perf_counter() - started_s
    document = {
        "machine": machine_before,
        "load_average_after_1_5_15_min": list(os.getloadavg()),
        "planner_revision": revision,
        "command": [sys.executable, *sys.argv],
        "quick": arguments.quick,
        "total_s": total_s,
        "models": {report.name: asdict(report) for report in reports},
    }
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(document, indent=1, allow_nan=False, default=str) + "\n")
    table = markdown(reports, quick=arguments.quick, context=machine_before)
    arguments.out.with_suffix(".md").write_text(table)
    sys.stdout.write(table)
    log.info("wrote %s and %s in %.1f s", arguments.out, arguments.out.with_suffix(".md"), total_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
