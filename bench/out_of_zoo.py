"""The sceptical sweep: Hugging Face models the planner was never built around, against every hand method.

Why it exists: the zoos hold the models the planner was fixed for, so passing them says little about the
next model a user brings. For each model of planner/testing/zoo_unseen.py this script does what such a
user would, and records what they would see:

- the measured peak of the model without checkpointing, and of `plan.module` without checkpointing
  (the captured module must cost no more than the model);
- every hand method of planner/testing/hand_methods.py ("every <Type>", "sqrt(n) segments", "own
  switch"), measured;
- our plan at each hand method's measured peak and at our own lowest predicted peak: predicted and
  measured peak, whether it fits, and its loss and gradients against the model's (one step, same seed,
  dropout active);
- or the error `optimize` raised, as the user would read it.

Peaks are two Adam steps under the live-storage tracker in 512-byte blocks (`planner.measure`). Run from
the repository root (about 13 min on 2 CPU cores); with `--models`, the named models' rows replace theirs
in the existing results:

    .venv/bin/python -m bench.out_of_zoo [--models mistral,whisper]

Writes `bench/results/out_of_zoo.json` and `bench/results/out_of_zoo.md`, whose table docs/coverage.md
quotes (bench/docs_tables.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import torch

import planner
from bench.docs_tables import refresh_quotes
from bench.peers import machine, mib, planner_revision
from planner.testing.hand_methods import hand_methods
from planner.testing.steps import gradient_error, one_step
from planner.testing.zoo_real import ExampleCall
from planner.testing.zoo_unseen import UNSEEN_ZOO

log = logging.getLogger("bench.out_of_zoo")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
REFERENCE_BUDGET_BYTES = 2**40
LOWEST = "our lowest"
REASON_CHARACTERS = 240
"""How much of a refusal's last reason (the module level's, where every level failed; lists of modules
shortened to [...]) the table shows."""
GRADIENT_SEED = 3
GRADIENT_TOLERANCE = 1e-5
"""Relative gradient error (plus loss difference) above which a plan does not train as the model. A model
whose own two steps under one seed differ by more (Reformer reseeds its dropout from the OS with
`torch.seed()`) has its plans' gradients recorded but not judged."""


def measured_bytes(module: torch.nn.Module, call: ExampleCall) -> int:
    return planner.measure(copy.deepcopy(module), call.args, example_kwargs=call.kwargs).peak_bytes


def step_error(module: torch.nn.Module, reference: ExampleCall) -> float:
    """Relative error of one seeded step's gradients of `module` (`loss.backward()`, as a training loop
    runs it: a custom autograd Function may write `.grad` itself) against a fresh copy of the reference
    model's, plus the absolute difference of the losses."""
    expected = one_step(reference.model, reference.args, kwargs=reference.kwargs, seed=GRADIENT_SEED)
    actual = one_step(module, reference.args, kwargs=reference.kwargs, seed=GRADIENT_SEED)
    return gradient_error(expected, actual) + abs(actual.loss.item() - expected.loss.item())


def planned_row(name: str, label: str, budget_bytes: int) -> dict[str, Any]:
    """Our plan of a fresh copy of the model at `budget_bytes`, measured and checked against the model."""
    call = UNSEEN_ZOO[name][1]()
    row: dict[str, Any] = {"at": label, "budget_bytes": budget_bytes}
    try:
        plan = planner.optimize(call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget_bytes)
    except Exception as error:  # noqa: BLE001 - a refusal at this budget is what the user sees: recorded
        row["error"] = f"{type(error).__name__}: {error}"
        return row
    assert plan.module is not None
    row["predicted_bytes"] = plan.predicted_peak_bytes
    row["measured_bytes"] = measured_bytes(plan.module, call)
    row["fits"] = row["measured_bytes"] <= budget_bytes
    row["regions"] = len(plan.regions)
    row["gradient_error"] = step_error(plan.module, UNSEEN_ZOO[name][1]())
    return row


def model_result(name: str) -> dict[str, Any]:
    description, build = UNSEEN_ZOO[name]
    started = time.perf_counter()
    result: dict[str, Any] = {"model": name, "description": description}
    call = build()
    result["model_bytes"] = measured_bytes(call.model, call)
    result["model_step_error"] = step_error(call.model, build())
    try:
        reference = planner.optimize(
            copy.deepcopy(call.model), call.args, example_kwargs=call.kwargs,
            budget_bytes=REFERENCE_BUDGET_BYTES,
        )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - a refusal or a crash is what the user sees: recorded
        result["error"] = f"{type(error).__name__}: {error}"
        result["seconds"] = round(time.perf_counter() - started, 1)
        return result
    assert reference.module is not None
    result["capture"] = reference.capture
    result["module_bytes"] = measured_bytes(reference.module, call)
    result["lowest_predicted_bytes"] = reference.min_peak_bytes
    result["hand_methods"] = {
        method.name: measured_bytes(method.variant.module, call)
        for method in hand_methods(call.model, call.args, kwargs=call.kwargs)
        if method.variant is not None
    }
    budgets = {**result["hand_methods"], LOWEST: reference.min_peak_bytes}
    result["plans"] = [planned_row(name, label, budget) for label, budget in budgets.items()]
    result["seconds"] = round(time.perf_counter() - started, 1)
    log.info("%s: %.0f s", name, result["seconds"])
    return result


def verdict(result: dict[str, Any]) -> str:
    if "error" in result and not result["error"].startswith("UnsupportedModel"):
        return "crashed: " + result["error"][:REASON_CHARACTERS]
    if "error" in result:
        reason = re.sub(r"\[[^\]]*\]", "[...]", result["error"].rsplit("; and ", 1)[-1])
        return "refused: " + reason[:REASON_CHARACTERS]
    plans = result["plans"]
    problems = []
    if result["module_bytes"] > result["model_bytes"]:
        problems.append("plan.module costs more than the model")
    if any(result["lowest_predicted_bytes"] > peak for peak in result["hand_methods"].values()):
        problems.append("a hand method beats our lowest")
    if not all(plan["fits"] for plan in plans if "fits" in plan):
        problems.append("a plan does not fit")
    if any("error" in plan and plan["budget_bytes"] >= result["lowest_predicted_bytes"] for plan in plans):
        problems.append("a budget at or above our lowest refused")
    reproducible = result.get("model_step_error", 0.0) <= GRADIENT_TOLERANCE
    if reproducible and any(plan.get("gradient_error", 0.0) > GRADIENT_TOLERANCE for plan in plans):
        problems.append("gradients differ")
    if not reproducible:
        problems.append("the model's own steps differ under one seed (gradients not compared)")
    return "; ".join(problems) or "ok"


def markdown(results: list[dict[str, Any]], context: dict[str, Any]) -> str:
    lines = [
        "# Models the planner was not built around, against every hand method",
        "",
        f"`python -m bench.out_of_zoo` at {context['revision'].get('commit', '?')}, torch "
        f"{context['machine']['torch_version']}, {context['machine']['cpu_count']} CPUs. Peaks are "
        'measured (two Adam steps, 512-byte blocks) unless marked predicted. "exact": plans whose '
        "prediction equals their measurement, of those made.",
        "",
        "| model | capture | model / plan.module, no checkpointing, MiB | best hand method, MiB | our "
        "lowest: predicted / measured, MiB | plans fitting | exact | predicted − measured | max gradient "
        "error | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if "error" in result:
            lines.append(
                f"| {result['model']} | - | {mib(result['model_bytes'])} / - | - | - | - | - | - | - | "
                f"{verdict(result)} |"
            )
            continue
        hands = result["hand_methods"]
        best = min(hands, key=hands.__getitem__) if hands else None
        plans = result["plans"]
        made = [plan for plan in plans if "measured_bytes" in plan]
        lowest = next(plan for plan in plans if plan["at"] == LOWEST)
        exact = sum(plan["predicted_bytes"] == plan["measured_bytes"] for plan in made)
        misses = [plan["predicted_bytes"] - plan["measured_bytes"] for plan in made]
        spread = f"{min(misses, default=0):+,} to {max(misses, default=0):+,} B"
        error = max((plan["gradient_error"] for plan in made), default=0.0)
        lines.append(
            f"| {result['model']} | {result['capture']} | {mib(result['model_bytes'])} / "
            f"{mib(result['module_bytes'])} | {best}: {mib(hands[best]) if best else '-'} | "
            f"{mib(result['lowest_predicted_bytes'])} / {mib(lowest.get('measured_bytes'))} | "
            f"{sum(bool(plan.get('fits')) for plan in plans)} of {len(plans)} | {exact} of {len(made)} | "
            f"{spread} | {error:.1e} | {verdict(result)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated names (default: all of zoo_unseen)")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = arguments.models.split(",") if arguments.models else list(UNSEEN_ZOO)
    unknown = sorted(set(names) - set(UNSEEN_ZOO))
    if unknown:
        parser.error(f"unknown models {unknown}; valid: {', '.join(UNSEEN_ZOO)}")
    json_path = RESULTS_DIRECTORY / "out_of_zoo.json"
    kept = json.loads(json_path.read_text())["results"] if arguments.models and json_path.exists() else []
    fresh = [model_result(name) for name in names]
    by_name = {result["model"]: result for result in kept} | {result["model"]: result for result in fresh}
    results = [by_name[name] for name in UNSEEN_ZOO if name in by_name]
    context = {"machine": machine(), "revision": planner_revision()}
    json_path.write_text(json.dumps({**context, "results": results}, indent=2) + "\n")
    (RESULTS_DIRECTORY / "out_of_zoo.md").write_text(markdown(results, context))
    refresh_quotes(RESULTS_DIRECTORY / "out_of_zoo.md")
    print(markdown(results, context))


if __name__ == "__main__":
    main()
