"""Coverage benchmark: which real models plan without edits, by which capture path, and how faithfully.

Why it exists: the planner's promise has to hold on the models people train, not only on the seed
threads' chains. For every entry of `planner.zoo_real` (Hugging Face GPT-2, BERT, Llama, T5 and ViT
from random-weight configs; nn.TransformerEncoder/Decoder; ResNet/DenseNet/U-Net-style CNNs; keyword
inputs with dataclass/dict/tuple outputs; in-place ops; tied weights; hooks; a root that branches on a
tensor) and for two of them under bf16 autocast, it records:

- the capture path `optimize` took (`fx`, `fx (opaque: ...)`, `export`, `module`) or the `UnsupportedModel`
  reason;
- at the mid budget `min + 0.5 (baseline - min)` of the plan's own predictions: the predicted and the
  measured peak (two real Adam steps, `planner.measure`), the relative error and whether it fits;
- whether one training step of `plan.module` gives the original's loss, gradients and buffers
  (same seed, dropout included), and the largest relative gradient difference.

It asserts nothing: a miss is a row. Run from the repository root:

    .venv/bin/python bench/coverage.py                        # every entry, ~3-6 min on 2 CPU cores
    .venv/bin/python bench/coverage.py --models resnet,hf_gpt2 --out /tmp/coverage.json

Results: JSON at `--out` (default `bench/results/coverage.json`) and the markdown table beside it
(`.md`), which README.md quotes under "Model coverage"; the table also goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import logging
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import planner
from planner.measurement import default_loss
from planner.zoo_real import REAL_ZOO, ExampleCall, build_call

log = logging.getLogger("bench.coverage")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
REFERENCE_BUDGET_BYTES = 2**40
MID_FRACTION = 0.5
PREDICTION_TOLERANCE = 0.05
GRADIENT_RTOL = 1e-6
STEP_SEED = 1234
AUTOCAST_ROWS = ("tied_lm", "hf_bert")
"""Entries also planned and trained under bf16 autocast."""
MIB = 2**20
REASON_CHARACTERS = 150
"""Characters of an UnsupportedModel message shown in the table (the JSON has all of it)."""


@dataclass
class CoverageRow:
    model: str
    precision: str
    capture: str
    nodes: int = 0
    regions: int = 0
    budget_bytes: int = 0
    predicted_peak_bytes: int = 0
    measured_peak_bytes: int = 0
    prediction_error: float = 0.0
    fits: bool = False
    same_loss_and_gradients: bool = False
    max_gradient_difference: float = 0.0
    optimize_s: float = 0.0
    unsupported: str = ""


@contextlib.contextmanager
def _precision(name: str) -> Iterator[None]:
    if name == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        yield


def _step(
    module: torch.nn.Module, call: ExampleCall, precision: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one step on a copy: forward under `precision`, backward outside it."""
    module = copy.deepcopy(module)
    torch.manual_seed(STEP_SEED)
    with _precision(precision):
        loss = default_loss(module(*call.args, **call.kwargs))
    loss.backward()
    gradients = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), gradients


def _compare(
    expected: tuple[torch.Tensor, dict[str, torch.Tensor]],
    actual: tuple[torch.Tensor, dict[str, torch.Tensor]],
) -> tuple[bool, float]:
    """(same within GRADIENT_RTOL, largest gradient difference relative to the gradient's scale)."""
    if expected[1].keys() != actual[1].keys():
        return False, float("inf")
    worst = max(
        ((actual[1][name] - gradient).abs().max() / (gradient.abs().max() or 1.0)).item()
        for name, gradient in expected[1].items()
    )
    same_loss = torch.allclose(actual[0], expected[0], rtol=GRADIENT_RTOL, atol=0.0)
    return same_loss and worst <= GRADIENT_RTOL, worst


def cover(name: str, precision: str) -> CoverageRow:
    call = build_call(name)
    arguments = {"example_kwargs": call.kwargs}
    try:
        with _precision(precision):
            reference = planner.optimize(
                call.model, call.args, budget_bytes=REFERENCE_BUDGET_BYTES, **arguments
            )
    except planner.UnsupportedModel as error:
        return CoverageRow(model=name, precision=precision, capture="unsupported", unsupported=str(error))
    budget = int(
        reference.min_peak_bytes + MID_FRACTION * (reference.baseline_peak_bytes - reference.min_peak_bytes)
    )
    started = time.perf_counter()
    with _precision(precision):
        plan = planner.optimize(call.model, call.args, budget_bytes=budget, **arguments)
    optimize_s = time.perf_counter() - started
    assert plan.module is not None
    with _precision(precision):
        measured = planner.measure(copy.deepcopy(plan.module), call.args, **arguments).peak_bytes
    same, worst = _compare(_step(call.model, call, precision), _step(plan.module, call, precision))
    return CoverageRow(
        model=name,
        precision=precision,
        capture=plan.capture,
        nodes=len(plan.graph.nodes),
        regions=len(plan.regions),
        budget_bytes=budget,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=measured,
        prediction_error=(plan.predicted_peak_bytes - measured) / measured,
        fits=measured <= budget,
        same_loss_and_gradients=same,
        max_gradient_difference=worst,
        optimize_s=optimize_s,
    )


def markdown(rows: list[CoverageRow]) -> str:
    lines = [
        "| model | precision | capture path | nodes | regions | budget MiB | predicted MiB | measured MiB "
        "| error | fits | loss & gradients |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    for row in rows:
        if row.unsupported:
            reason = row.unsupported.split(": ", 1)[-1].replace("|", "/")
            reason = reason if len(reason) <= REASON_CHARACTERS else reason[:REASON_CHARACTERS] + " ..."
            lines.append(f"| {row.model} | {row.precision} | unsupported: {reason} | | | | | | | | |")
            continue
        gradients = "equal" if row.same_loss_and_gradients else f"differ ({row.max_gradient_difference:.1e})"
        lines.append(
            f"| {row.model} | {row.precision} | {row.capture} | {row.nodes} | {row.regions} "
            f"| {row.budget_bytes / MIB:.2f} | {row.predicted_peak_bytes / MIB:.2f} "
            f"| {row.measured_peak_bytes / MIB:.2f} | {row.prediction_error:+.1%} "
            f"| {'yes' if row.fits else 'NO'} | {gradients} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(REAL_ZOO)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIRECTORY / "coverage.json")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    names = arguments.models.split(",") if arguments.models else list(REAL_ZOO)
    unknown = [name for name in names if name not in REAL_ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(REAL_ZOO)}")
    required = {entry.requires for name in names if (entry := REAL_ZOO[name]).requires}
    missing = {package for package in required if importlib.util.find_spec(package) is None}
    if missing:
        parser.error(f"install {sorted(missing)} for the Hugging Face entries: pip install -e '.[dev]'")
    jobs = [(name, "fp32") for name in names] + [(name, "bf16") for name in AUTOCAST_ROWS if name in names]
    rows = []
    for name, precision in jobs:
        log.info("%s (%s)", name, precision)
        rows.append(cover(name, precision))
    table = markdown(rows)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu": platform.processor(),
        },
        "mid_fraction": MID_FRACTION,
        "rows": [asdict(row) for row in rows],
    }
    arguments.out.write_text(json.dumps(document, indent=1) + "\n")
    arguments.out.with_suffix(".md").write_text(table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
