"""Coverage benchmark: which real models plan without edits, by which capture path, and how faithfully.

Why it exists: the planner's promise has to hold on the models people train, not only on the seed
threads' chains. For every entry of `planner.testing.zoo_real` (Hugging Face GPT-2, BERT, Llama, T5 and ViT
from random-weight configs; nn.TransformerEncoder/Decoder; ResNet/DenseNet/U-Net-style CNNs; keyword
inputs with dataclass/dict/tuple outputs; in-place ops; tied weights; hooks; a root that branches on a
tensor) and for five of them under bf16 autocast (`--bf16 all`: every one), it records:

- the capture path `optimize` took (`fx`, `fx (opaque: ...)`, `export`, `module`) or the `UnsupportedModel`
  reason;
- at the mid budget `min + 0.5 (baseline - min)` of the plan's own predictions: the predicted and the
  measured peak (two real Adam steps, `planner.measure`), the relative error and whether it fits;
- whether one training step of `plan.module` gives the original's loss, gradients and buffers
  (same seed, dropout included), and the largest relative gradient difference;
- other shapes: the example with half the batch, and with half the sequence (every dimension of the
  first 2-D input's length halved, where the original model runs at it): whether `plan.module` trains
  there with the original's loss and gradients, and its measured peak against the budget (made for
  the example: smaller calls must fit it);
- whether `plan.module.forward` has the original's signature (what the Hugging Face Trainer filters a
  batch's columns by).

It asserts nothing: a miss is a row. Run from the repository root:

    .venv/bin/python -m bench.coverage                        # every entry, ~3-6 min on 2 CPU cores
    .venv/bin/python -m bench.coverage --models resnet,hf_gpt2 --out /tmp/coverage.json
    .venv/bin/python -m bench.coverage --bf16 all --out /tmp/coverage_bf16.json   # ~10 min

Results: JSON at `--out` (default `bench/results/coverage.json`) and the markdown table beside it
(`.md`; the table also goes to stdout). Writing the default results also rewrites the table docs/coverage.md
quotes (bench/docs_tables.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import inspect
import json
import logging
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import planner
from bench.docs_tables import refresh_quotes
from planner.testing.steps import StepRecord, max_gradient_difference, one_step
from planner.testing.zoo_real import REAL_ZOO, ExampleCall, build_call

log = logging.getLogger("bench.coverage")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
MID_FRACTION = 0.5
PREDICTION_TOLERANCE = 0.05
GRADIENT_RTOL = 1e-6
AUTOCAST_ROWS = ("tied_lm", "hooked_mlp", "branching_root", "inplace_mlp", "hf_bert")
"""Entries also planned and trained under bf16 autocast by default: a language model with selective
keeps of Linears, the two whose calls run as Python code (NOTE [split calls]), in-place ops (see
docs/limits.md) and an exported Hugging Face model."""
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
    other_shapes: str = ""
    """"yes" when plan.module trained at every smaller shape with the original's loss and gradients,
    else what went wrong."""
    half_batch_measured_bytes: int | None = None
    half_sequence_measured_bytes: int | None = None
    """Measured peaks at half the batch and half the sequence; None where the original does not run."""
    trainer_signature: bool = False
    unsupported: str = ""

    @property
    def half_shapes_fit(self) -> bool:
        peaks = [self.half_batch_measured_bytes, self.half_sequence_measured_bytes]
        return all(peak <= self.budget_bytes for peak in peaks if peak is not None)


@contextlib.contextmanager
def _precision(name: str) -> Iterator[None]:
    if name == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        yield


def _step(module: torch.nn.Module, call: ExampleCall, precision: str) -> StepRecord:
    """Loss and gradients of one step on a copy: forward under `precision`, backward outside it."""
    return one_step(module, call.args, kwargs=call.kwargs, forward_context=_precision(precision))


def _compare(expected: StepRecord, actual: StepRecord) -> tuple[bool, float]:
    """(same within GRADIENT_RTOL, largest gradient difference relative to the gradient's scale)."""
    worst = max_gradient_difference(expected, actual)
    same_loss = torch.allclose(actual.loss, expected.loss, rtol=GRADIENT_RTOL, atol=0.0)
    return same_loss and worst <= GRADIENT_RTOL, worst


def _halved_batch(value: Any, batch: int) -> Any:
    """Dimension 0 halved where it is the batch."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[: batch // 2].contiguous()
    return value


def _halved_length(value: Any, batch: int, length: int) -> Any:
    """Every dimension of size `length` halved, but a batch dimension (a causal mask's two are halved)."""
    if not isinstance(value, torch.Tensor):
        return value
    index = tuple(
        slice(0, size // 2) if size == length and not (dim == 0 and size == batch) else slice(None)
        for dim, size in enumerate(value.shape)
    )
    return value[index].contiguous()


def smaller_calls(call: ExampleCall) -> dict[str, ExampleCall]:
    """The example with half the batch (the first input's first dimension) and with half the sequence
    (the first 2-D input's second dimension), each left out where the original model cannot run it."""
    tensors = [t for t in (*call.args, *call.kwargs.values()) if isinstance(t, torch.Tensor) and t.dim()]
    batch = tensors[0].shape[0]
    lengths = [t.shape[1] for t in tensors if t.dim() >= 2]
    shrinkers = {"batch": functools.partial(_halved_batch, batch=batch)}
    if lengths and lengths[0] != batch:
        shrinkers["sequence"] = functools.partial(_halved_length, batch=batch, length=lengths[0])
    calls = {}
    for kind, shrink in shrinkers.items():
        kwargs = {key: shrink(value) for key, value in call.kwargs.items()}
        smaller = ExampleCall(call.model, tuple(map(shrink, call.args)), kwargs)
        try:
            _step(call.model, smaller, "fp32")
        except Exception as error:  # noqa: BLE001 - the original does not run there: not one of its shapes
            log.info("%s does not run at half the %s (%s)", type(call.model).__name__, kind, error)
            continue
        calls[kind] = smaller
    return calls


def other_shapes(plan: planner.Plan, call: ExampleCall, precision: str) -> tuple[str, dict[str, int]]:
    """("yes" or what failed, measured peak per smaller call) of plan.module at the smaller calls."""
    assert plan.module is not None
    measured: dict[str, int] = {}
    failures = []
    for kind, smaller in smaller_calls(call).items():
        try:
            expected = _step(call.model, smaller, precision)
            same, worst = _compare(expected, _step(plan.module, smaller, precision))
            with _precision(precision):
                measured[kind] = planner.measure(
                    copy.deepcopy(plan.module), smaller.args, example_kwargs=smaller.kwargs
                ).peak_bytes
        except Exception as error:  # noqa: BLE001 - a failure is a row, not a crash
            failures.append(f"half {kind}: {type(error).__name__}: {error}")
            continue
        if not same:
            failures.append(f"half {kind}: gradients differ ({worst:.1e})")
    return ("; ".join(failures) or "yes"), measured


def _fails_without_planner(call: ExampleCall, precision: str) -> str | None:
    """Why the original model cannot run its forward under `precision` (None when it can): a row
    for a model that fails without the planner says so rather than stopping the run."""
    try:
        with torch.no_grad(), _precision(precision):
            copy.deepcopy(call.model)(*call.args, **call.kwargs)
    except RuntimeError as error:
        return f"the model alone: fails under {precision} without the planner - {error}"
    return None


def cover(name: str, precision: str) -> CoverageRow:
    call = build_call(name)
    if (failure := _fails_without_planner(call, precision)) is not None:
        return CoverageRow(model=name, precision=precision, capture="unsupported", unsupported=failure)
    arguments = {"example_kwargs": call.kwargs}
    started = time.perf_counter()
    try:
        with _precision(precision):
            profile = planner.profile(call.model, call.args, **arguments)
    except planner.UnsupportedModel as error:
        return CoverageRow(model=name, precision=precision, capture="unsupported", unsupported=str(error))
    frontier = profile.pareto(points=2, solver="dp")
    budget = int(
        frontier.min_peak_bytes + MID_FRACTION * (frontier.baseline_peak_bytes - frontier.min_peak_bytes)
    )
    plan = profile.plan(budget_bytes=budget)
    optimize_s = time.perf_counter() - started
    assert plan.module is not None
    with _precision(precision):
        measured = planner.measure(copy.deepcopy(plan.module), call.args, **arguments).peak_bytes
    same, worst = _compare(_step(call.model, call, precision), _step(plan.module, call, precision))
    shapes, smaller_peaks = other_shapes(plan, call, precision)
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
        other_shapes=shapes,
        half_batch_measured_bytes=smaller_peaks.get("batch"),
        half_sequence_measured_bytes=smaller_peaks.get("sequence"),
        trainer_signature=inspect.signature(plan.module.forward) == inspect.signature(call.model.forward),
    )


def markdown(rows: list[CoverageRow]) -> str:
    lines = [
        "| model | precision | capture path | nodes | regions | budget MiB | predicted MiB | measured MiB "
        "| error | fits | loss & gradients | other shapes | half batch / half sequence, measured MiB "
        "| Trainer signature |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|:---:|:---:|:---:|---:|:---:|",
    ]
    for row in rows:
        if row.unsupported:
            reason = row.unsupported.split(": ", 1)[-1].replace("|", "/")
            reason = reason if len(reason) <= REASON_CHARACTERS else reason[:REASON_CHARACTERS] + " ..."
            lines.append(f"| {row.model} | {row.precision} | unsupported: {reason} | | | | | | | | | | | |")
            continue
        gradients = "equal" if row.same_loss_and_gradients else f"differ ({row.max_gradient_difference:.1e})"
        lines.append(
            f"| {row.model} | {row.precision} | {row.capture} | {row.nodes} | {row.regions} "
            f"| {row.budget_bytes / MIB:.2f} | {row.predicted_peak_bytes / MIB:.2f} "
            f"| {row.measured_peak_bytes / MIB:.2f} | {row.prediction_error:+.1%} "
            f"| {'yes' if row.fits else 'NO'} | {gradients} | {_short(row.other_shapes)} "
            f"| {_half_peaks(row)} | {'yes' if row.trainer_signature else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _short(text: str) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= REASON_CHARACTERS else text[:REASON_CHARACTERS] + " ..."


def _half_peaks(row: CoverageRow) -> str:
    peaks = [row.half_batch_measured_bytes, row.half_sequence_measured_bytes]
    figures = " / ".join("n/a" if peak is None else f"{peak / MIB:.2f}" for peak in peaks)
    return f"{figures} ({'fit' if row.half_shapes_fit else 'OVER'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(REAL_ZOO)}")
    parser.add_argument(
        "--bf16",
        default=",".join(AUTOCAST_ROWS),
        help="comma-separated entries also planned under bf16 autocast, or 'all' (default: %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIRECTORY / "coverage.json")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    names = arguments.models.split(",") if arguments.models else list(REAL_ZOO)
    autocast = list(REAL_ZOO) if arguments.bf16 == "all" else [n for n in arguments.bf16.split(",") if n]
    unknown = [name for name in (*names, *autocast) if name not in REAL_ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(REAL_ZOO)}")
    required = {entry.requires for name in names if (entry := REAL_ZOO[name]).requires}
    missing = {package for package in required if importlib.util.find_spec(package) is None}
    if missing:
        parser.error(f"install {sorted(missing)} for the Hugging Face entries: pip install -e '.[dev]'")
    jobs = [(name, "fp32") for name in names] + [(name, "bf16") for name in autocast if name in names]
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
        "rows": [asdict(row) | {"half_shapes_fit": row.half_shapes_fit} for row in rows],
    }
    arguments.out.write_text(json.dumps(document, indent=1) + "\n")
    arguments.out.with_suffix(".md").write_text(table)
    refresh_quotes(arguments.out.with_suffix(".md"))
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
