"""`python -m planner.demo`: the seed-003 thread, answered by the planner (the README's `make demo`).

The user wrapped a whole FeedForward stack in `checkpoint_wrapper` and saw the peak after backward go
*up*. The demo measures that, then plans the same model at a budget between the lowest achievable
peak and no checkpointing, prints the plan's report, and measures the planned module. Every figure is
labelled measured (live tensor storages, two Adam steps) or predicted (the simulator).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

import planner
from planner.errors import format_bytes
from planner.zoo import ZOO, build_model

__all__ = ["main"]

DEFAULT_MODEL = "seed003_feedforward"
DEFAULT_FRACTION = 0.5


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m planner.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(ZOO), help="zoo model to plan")
    parser.add_argument(
        "--budget-mib", type=float, help="budget in MiB (default: halfway from lowest to baseline)"
    )
    parser.add_argument("--verbose", action="store_true", help="log each planning stage")
    return parser.parse_args(argv)


def _measured(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    return planner.measure(copy.deepcopy(module), inputs).peak_bytes


def main(argv: list[str] | None = None) -> int:
    arguments = _arguments(argv)
    logging.basicConfig(level=logging.INFO if arguments.verbose else logging.WARNING, format="%(message)s")
    model, inputs = build_model(arguments.model)
    print(f"model: {arguments.model} - {ZOO[arguments.model].description}")

    baseline_bytes = _measured(model, inputs)
    wrapped_bytes = _measured(checkpoint_wrapper(model, checkpoint_impl=CheckpointImpl.NO_REENTRANT), inputs)
    print(f"measured peak, no checkpointing:               {format_bytes(baseline_bytes):>12}")
    change = (
        "saves nothing"
        if wrapped_bytes >= baseline_bytes
        else f"saves {format_bytes(baseline_bytes - wrapped_bytes)}"
    )
    print(f"measured peak, checkpoint_wrapper(whole model): {format_bytes(wrapped_bytes):>12}  ({change})")

    if arguments.budget_mib is not None:
        budget_bytes = int(arguments.budget_mib * 2**20)
    else:
        reference = planner.optimize(model, inputs, budget_bytes=2**40)
        budget_bytes = int(
            reference.min_peak_bytes
            + DEFAULT_FRACTION * (reference.baseline_peak_bytes - reference.min_peak_bytes)
        )
    try:
        plan = planner.optimize(model, inputs, budget_bytes=budget_bytes)
    except planner.InfeasibleBudget as error:
        print(f"\n{error}")
        return 3
    print()
    print(plan.summary())
    assert plan.module is not None
    planned_bytes = _measured(plan.module, inputs)
    prediction_error = (plan.predicted_peak_bytes - planned_bytes) / planned_bytes
    verdict = "within" if planned_bytes <= budget_bytes else "OVER"
    print(
        f"\nmeasured peak of plan.module: {format_bytes(planned_bytes)} "
        f"({verdict} the budget; prediction off by {prediction_error:+.2%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
