"""Predicted against measured peaks of compiled plans, on models the compiled planner was not built around.

Why it exists: `optimize(..., compile=True)` predicts inductor's memory from rules found on the zoos'
models, and checks each plan once it is compiled (NOTE [checked budget]), replanning below a budget
its plan measured over. A prediction that is low costs compilations and, at the lowest plan, a false
"impossible"; one that is high leaves memory unused. This bench plans the models of
planner/testing/compiled_models.py, with and without `torch._inductor.config.fallback_random` (what
users set to make compiled dropout reproducible), at budgets spread over the predicted range (the
lowest peak, 0.1 and 0.5 of the way to no checkpointing, no checkpointing) and at the measured peak
of `torch.compile` itself at `activation_memory_budget` 1.0, 0.5 and 0 (a hand method's memory: at
that budget "impossible" would be false). Each row compiles our plan on a fresh model and reports:

- predicted: `plan.predicted_peak_bytes`, the whole training step (Adam, as below);
- measured: two Adam steps of `plan.module` counted by the CPU allocator's events
  (bench/compare_measurement.py `allocator_step_memory`, as `bench.compare` counts compiled rows);
- the verdict: within 2 % of measured, an upper bound (more than 2 % above), or **low**.

    .venv/bin/python -m bench.compiled_check              # 11-30 minutes on this 2-core CPU
    .venv/bin/python -m bench.compiled_check --models encoder_vit --out /tmp/compiled_check.json
    .venv/bin/python -m bench.compiled_check --render   # the markdown again from the JSON

Results: JSON at `--out` (default bench/results/compiled_check.json) and a markdown table beside it,
which docs/compiled.md quotes (bench/docs_tables.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

import planner
from bench.compare_measurement import allocator_step_memory, compiled, compiler_settings
from bench.docs_tables import refresh_quotes
from bench.peers import machine, mib, planner_revision
from bench.prediction_verdicts import deviation, verdict
from planner.compiled.optimize import plan_compiled_step
from planner.errors import InfeasibleBudget
from planner.ir import TrainingStep
from planner.profiler.measurement import default_loss
from planner.testing.compiled_models import COMPILED_CHECK_MODELS
from planner.testing.steps import seeded_gradients, variant_of

log = logging.getLogger("bench.compiled_check")

RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (0.0, 0.1, 0.5, 1.0)
"""Budgets at lowest + f x (no checkpointing - lowest), both predicted."""
PEER_BUDGETS = (1.0, 0.5, 0.0)
"""`activation_memory_budget` values whose measured compiled peak is also a budget of ours."""
NO_CHECKPOINTING = 1.0
"""torch.compile's default partition, whose gradients each peer's are compared with (same seed,
`STEP_SEED`)."""
GRADIENT_RTOL = 1e-4
"""A peer's gradients differ from torch.compile's without checkpointing by more than this (relative
norm over the model) when it draws other dropout masks: `fallback_random` with a budget below 1.0."""


@dataclass
class CheckRow:
    """One budget of one model and setting: what we predicted, what it measured, and the verdict."""

    model: str
    fallback_random: bool
    budget: str
    budget_bytes: int
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    compilations: int | None = None
    checkpointed_regions: int | None = None
    infeasible: str | None = None
    """`InfeasibleBudget`'s message where optimize refused the budget; the row's predicted and
    measured peaks are then the predicted lowest and the lowest a compilation measured."""
    error: str | None = None
    """What went wrong planning or measuring the row, other than a refusal (the run goes on)."""
    peer_gradient_error: float | None = None
    """For a budget set by torch.compile: its gradients against torch.compile's without checkpointing."""


def row_verdict(row: CheckRow) -> str:
    """`verdict` of the predicted peak; for a refused budget, of the predicted lowest peak against the
    lowest a compilation measured, and false where torch.compile fitted that budget."""
    if row.error is not None:
        return f"**error**: {row.error[:120]}"
    if row.infeasible is not None and row.peer_gradient_error is not None:
        if row.peer_gradient_error > GRADIENT_RTOL:
            return (
                f"refused; torch.compile fits it with wrong gradients (error {row.peer_gradient_error:.1e})"
            )
        return "**refused as impossible, but torch.compile fits**"
    judged = verdict(row.predicted_peak_bytes, row.measured_peak_bytes)
    return f"refused; predicted lowest {judged}" if row.infeasible is not None else judged


def _planned_row(
    model: str, fallback_random: bool, budget: str, budget_bytes: int, lowest_bytes: int, **sizes: Any
) -> CheckRow:
    """Our compiled plan at `budget_bytes`, measured; where it is refused, the predicted lowest peak
    (`lowest_bytes`) against the lowest peak a compilation measured."""
    row = CheckRow(model, fallback_random, budget, budget_bytes)
    call = COMPILED_CHECK_MODELS[model](**sizes)
    try:
        plan = planner.optimize(
            call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget_bytes, compile=True
        )
    except InfeasibleBudget as refusal:
        row.infeasible = str(refusal).splitlines()[0]
        row.predicted_peak_bytes = lowest_bytes
        row.measured_peak_bytes = refusal.min_peak_bytes  # the lowest a compiled plan measured
        return row
    except Exception as error:  # one failed row must not lose the others
        log.exception("%s %s: planning failed", model, budget)
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return row
    assert plan.module is not None and plan.compiled is not None
    row.predicted_peak_bytes = plan.predicted_peak_bytes
    row.compilations, row.checkpointed_regions = plan.compiled.attempts, len(plan.regions)
    row.measured_peak_bytes = allocator_step_memory(plan.module, call).peak_bytes
    return row


def _peer(model: str, fraction: float, **sizes: Any) -> tuple[int, torch.Tensor]:
    """`torch.compile` at `activation_memory_budget=fraction`: its measured peak and one step's gradients."""
    call = COMPILED_CHECK_MODELS[model](**sizes)
    module = compiled(variant_of(call.model), fraction).module
    _, gradients = seeded_gradients(module, list(call.model.parameters()), call.args, call.kwargs)
    return allocator_step_memory(module, call).peak_bytes, gradients


def check_model(model: str, fallback_random: bool, **sizes: Any) -> list[CheckRow]:
    """Every row of one model under one setting of `fallback_random`."""
    with torch._inductor.config.patch(fallback_random=fallback_random), compiler_settings():
        call = COMPILED_CHECK_MODELS[model](**sizes)
        reference = plan_compiled_step(
            call.model, call.args, call.kwargs, budget_bytes=2**50, optimizer="adam", step=TrainingStep(),
            loss_fn=default_loss, solver="auto", device=None,
        )  # fmt: skip
        lowest, baseline = reference.min_peak_bytes, reference.baseline_peak_bytes
        budgets = [(f"predicted range {f:g}", int(lowest + f * (baseline - lowest))) for f in FRACTIONS]
        peers = {fraction: _peer(model, fraction, **sizes) for fraction in PEER_BUDGETS}
        unplanned = peers[NO_CHECKPOINTING][1]
        errors: dict[str, float | None] = {label: None for label, _ in budgets}
        for fraction, (peak_bytes, gradients) in peers.items():
            label = f"torch.compile budget {fraction:g}"
            budgets.append((label, peak_bytes))
            errors[label] = ((gradients - unplanned).norm() / unplanned.norm()).item()
        rows = []
        for label, budget_bytes in budgets:
            started = time.perf_counter()
            rows.append(_planned_row(model, fallback_random, label, budget_bytes, lowest, **sizes))
            rows[-1].peer_gradient_error = errors[label]
            log.info("%s (fallback_random=%s) %s: %s in %.0f s", model, fallback_random, label,
                     row_verdict(rows[-1]), time.perf_counter() - started)  # fmt: skip
        return rows


def markdown(rows: Sequence[CheckRow], context: dict[str, Any]) -> str:
    lines = [
        "# Compiled predictions on models not built for them",
        "",
        f"{context['machine']['processor']}, {context['machine']['cpu_count']} CPUs, torch "
        f"{context['machine']['torch_version']}, commit {context['revision'].get('commit', '?')[:7]}; "
        f"{context['total_s'] / 60:.1f} minutes. Command: `{' '.join(context['command'])}`",
        "",
        "Measured: two Adam steps of `plan.module`, CPU allocator events plus parameters, buffers and "
        "inputs. Within 2 %: |predicted - measured| <= 2 % of measured.",
        "",
        "| model | fallback_random | budget | budget (MiB) | predicted (MiB) | measured (MiB) | "
        "predicted - measured | verdict | compilations |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        off = deviation(row.predicted_peak_bytes, row.measured_peak_bytes)
        lines.append(
            f"| {row.model} | {row.fallback_random} | {row.budget} | {mib(row.budget_bytes)} | "
            f"{mib(row.predicted_peak_bytes)} | {mib(row.measured_peak_bytes)} | "
            f"{'—' if off is None else f'{off:+.2%}'} | {row_verdict(row)} | "
            f"{row.compilations if row.compilations is not None else '—'} |"
        )
    kinds = ("within", "upper", "**", "wrong gradients")
    counts = {kind: sum(kind in row_verdict(row) for row in rows) for kind in kinds}
    lines += [
        "",
        f"{counts['within']} of {len(rows)} rows within 2 %, {counts['upper']} upper bounds, {counts['**']} "
        f"low or falsely refused, {counts['wrong gradients']} refused where only torch.compile with wrong "
        "gradients fits. A refused row compares the predicted lowest peak with the lowest peak a "
        "compilation measured (NOTE [checked budget]).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(COMPILED_CHECK_MODELS), help="comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS / "compiled_check.json")
    parser.add_argument(
        "--render", action="store_true", help="rewrite the markdown of --out's JSON, measuring nothing"
    )
    arguments = parser.parse_args(argv)
    if arguments.render:
        print(render(arguments.out))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    rows: list[CheckRow] = []
    table = ""
    for model in arguments.models.split(","):
        for fallback_random in (False, True):
            rows += check_model(model, fallback_random)
            table = write_results(rows, arguments.out, started, argv)  # what is done so far is kept
    print(table)


def render(out: Path) -> str:
    """The markdown beside `out` (and the docs quoting it) from the rows the JSON there holds."""
    document = json.loads(out.read_text())
    names = {field.name for field in fields(CheckRow)}
    rows = [
        CheckRow(**{key: value for key, value in row.items() if key in names}) for row in document["rows"]
    ]
    table = markdown(rows, document)
    out.with_suffix(".md").write_text(table)
    refresh_quotes(out.with_suffix(".md"))
    return table


def write_results(rows: Sequence[CheckRow], out: Path, started: float, argv: Sequence[str] | None) -> str:
    """The JSON at `out` and the markdown beside it (quoted in docs/compiled.md); the markdown."""
    context = {
        "machine": machine(),
        "revision": planner_revision(),
        "total_s": time.perf_counter() - started,
        "command": ["python", "-m", "bench.compiled_check", *(argv or [])],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    records = [
        asdict(row)
        | {
            "deviation": deviation(row.predicted_peak_bytes, row.measured_peak_bytes),
            "verdict": row_verdict(row),
        }
        for row in rows
    ]
    out.write_text(json.dumps({**context, "rows": records}, indent=2) + "\n")
    table = markdown(rows, context)
    out.with_suffix(".md").write_text(table)
    refresh_quotes(out.with_suffix(".md"))
    return table


if __name__ == "__main__":
    main()
