"""`planner.capacity`: the largest batch or sequence whose training step fits a card, with and without
checkpointing, and the fastest way (checkpointing, accumulation, bf16 autocast) to a global batch.

Why it exists: people start from a card, not a budget ("I have 24 GB: what batch can I train at?"),
and answer it by trial and out-of-memory errors. The planner already predicts a step's peak for any plan
on a GPU it does not have (the meta device and the analytic cost model); this searches sizes on those
predictions.

    table = planner.capacity(model, lambda batch: torch.randint(32000, (batch, 1024)),
                             batch=range(1, 513), device="a100-40gb")
    print(table)                 # largest batch without and with checkpointing; the sizes probed
    plan = table.plan()          # the plan at the largest batch that fits with checkpointing

How it works (fitting.py has the search and the weighing, rescale.py the reused captures):
- A probed size is one capture and profiling step (`_profile_size`, the one call into the profiling
  pipeline) or, with analytic costs, a graph rescaled from captures at three other sizes after a fourth
  capture confirmed the rescaling (NOTE [rescaling] in rescale.py). Every size a table answers with is
  confirmed by a capture of its own; when that capture differs from the rescaled graph, reuse is dropped
  and the search runs again on captures alone.
- Both peaks come from one graph per size: no checkpointing (`store_everything`) and the lowest any
  plan reaches (`lowest_peak`); the search bisects on each (NOTE [monotone peaks] in fitting.py).
- The step is the one `optimize` plans (`TrainingStep`); weighing accumulation against checkpointing
  plans each micro-batch for the step with every gradient alive (NOTE [weighing options]).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from planner.errors import format_bytes
from planner.ir import ActivationGraph, CostModel, MemoryCounting, SimulationResult, TrainingStep
from planner.one_call import optimize
from planner.planning.model import budget_bytes_of, memory_counting_of, profile, training_step_of
from planner.planning.plan import Plan
from planner.profiler.cost_model import DeviceSpec, device_spec
from planner.profiler.measurement import OptimizerSpec, tensors_in
from planner.simulation.step import for_training_step, simulate, store_everything
from planner.sizing.fitting import (
    Price,
    Priced,
    SizeRow,
    Weighing,
    check_monotone,
    largest_fitting,
    render_rows,
    render_weighing,
    weigh,
)
from planner.sizing.rescale import FIT_SIZES, GraphFamily, NotRescalable
from planner.solvers import lowest_peak, solve

__all__ = ["CARD_MEMORIES_GIB", "Capacity", "ProgressCallback", "capacity"]

log = logging.getLogger(__name__)

DIMENSIONS = ("batch", "sequence")
CAPTURED, RESCALED = "captured", "rescaled"
CARD_MEMORIES_GIB = (16, 24, 40, 48, 80)
"""Card memories the capacity plot compares: the common sizes of training GPUs."""
SMALLEST_FIT_SIZE = 2
"""Rescaling is fitted from sizes of at least 2: a dimension of size 1 may be specialised away (a
squeezed or broadcast dimension), so the graph at 1 need not be the graph at 2 rescaled."""
BF16 = "bf16 autocast"

ProgressCallback = Callable[[int, int, str], None]
"""(graphs obtained so far, graphs expected, what the last one was): for a progress bar. The expected
count is an estimate and may grow."""

SizeSpec = int | range | Sequence[int] | None
"""A searched dimension (a range or sorted sizes), a fixed one (an int), or absent (None)."""


@dataclass(frozen=True)
class _Settings:
    """What every capture of one configuration shares."""

    optimizer: OptimizerSpec
    step: TrainingStep
    loss_fn: Callable[[Any], torch.Tensor] | None
    cost_model: str
    device: str | DeviceSpec | None
    autocast: torch.dtype | None
    solver: str
    memory_counting: MemoryCounting = MemoryCounting.BLOCKS

    def step_options(self) -> dict[str, Any]:
        """The keywords that describe the step to `optimize` and to profiling alike."""
        return {
            "optimizer": self.optimizer,
            "step": self.step,
            "loss_fn": self.loss_fn,
            "cost_model": self.cost_model,
            "device": self.device,
            "memory_counting": self.memory_counting,
        }


@dataclass(frozen=True)
class _Call:
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] | None


def _split_inputs(made: Any, sizes: Mapping[str, int]) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """make_inputs' result as (positional, keyword) example inputs."""
    if isinstance(made, torch.Tensor):
        return (made,), None
    if isinstance(made, Mapping):
        return (), dict(made)
    if isinstance(made, tuple | list):
        return tuple(made), None
    raise TypeError(
        f"make_inputs({', '.join(f'{k}={v}' for k, v in sizes.items())}) returned {type(made).__name__}; "
        "return a tensor, a tuple of the forward's positional inputs, or a dict of keyword inputs"
    )


@dataclass
class _Target:
    """The model and its example inputs at each size (built once per size)."""

    model: torch.nn.Module | Callable[..., Any]
    make_inputs: Callable[..., Any] | None
    """None: `model` is a factory of (model, example_inputs)."""
    dimension: str
    fixed: dict[str, int]
    calls: dict[int, _Call] = field(default_factory=dict)

    def call(self, size: int) -> _Call:
        if size not in self.calls:
            sizes = {**self.fixed, self.dimension: size}
            if isinstance(self.model, torch.nn.Module):
                model, made = self.model, self._inputs(sizes)
            elif self.make_inputs is None:
                model, made = _model_and_inputs(self.model(**sizes), sizes)
            else:
                model, made = self.model(**sizes), self._inputs(sizes)
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"the model factory returned {type(model).__name__} for {sizes}, not a Module"
                )
            self.calls[size] = _Call(model, *_split_inputs(made, sizes))
        return self.calls[size]

    def _inputs(self, sizes: dict[str, int]) -> Any:
        if self.make_inputs is None:
            raise TypeError("give make_inputs(**sizes) with a model, or a factory of (model, example_inputs)")
        return self.make_inputs(**sizes)

    def on_meta(self, size: int) -> bool:
        call = self.call(size)
        return any(t.is_meta for t in [*call.model.parameters(), *tensors_in((call.args, call.kwargs))])


def _model_and_inputs(made: Any, sizes: Mapping[str, int]) -> tuple[Any, Any]:
    """A factory's (model, example_inputs), checked."""
    if not (isinstance(made, tuple) and len(made) == 2):
        raise TypeError(
            f"the factory returned {type(made).__name__} for {dict(sizes)}; without make_inputs it must "
            "return (model, example_inputs)"
        )
    return made


def _autocast(call: _Call, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    """`torch.autocast` on the device of the model's tensors (profiling runs forward and loss in it)."""
    if dtype is None:
        return nullcontext()
    tensors = [*call.model.parameters(), *tensors_in((call.args, call.kwargs))]
    device_type = tensors[0].device.type if tensors else "cpu"
    if device_type == "meta":
        raise ValueError(
            "autocast cannot be planned on the meta device: torch.autocast does not act on meta tensors. "
            "Plan on real tensors, or build the model in bf16 (model.to(torch.bfloat16)) to plan pure "
            "bf16 training"
        )
    return torch.autocast(device_type, dtype=dtype)


def _profile_size(call: _Call, settings: _Settings) -> ActivationGraph:
    """The activation graph of one micro-batch at one size, as profiled (before the training step's
    accumulation is applied): the one call into the profiling pipeline (`planner.profile`)."""
    with _autocast(call, settings.autocast):
        profiled = profile(call.model, call.args, example_kwargs=call.kwargs, **settings.step_options())
    return profiled.profiled_graph


class _Progress:
    """Counts graphs obtained and reports them to the caller's callback."""

    def __init__(self, callback: ProgressCallback | None, expected: int) -> None:
        self.callback = callback
        self.expected = expected
        self.done = 0

    def tick(self, message: str) -> None:
        self.done += 1
        self.expected = max(self.expected, self.done)
        log.info("%s (%d of about %d)", message, self.done, self.expected)
        if self.callback is not None:
            self.callback(self.done, self.expected, message)


class _Prober:
    """Profiled graphs by size for one configuration: captured, or rescaled from captures."""

    def __init__(
        self,
        target: _Target,
        settings: _Settings,
        *,
        candidates: Sequence[int],
        reuse: bool,
        progress: _Progress,
    ) -> None:
        self.target = target
        self.settings = settings
        self.candidates = candidates
        self.progress = progress
        self.samples: dict[int, tuple[ActivationGraph, str]] = {}
        self.family: GraphFamily | None = None
        self.reuse_note: str | None = None
        """Why captures are not reused (None while they are, or before it is known)."""
        self._fit_tried = not reuse

    def _label(self, size: int) -> str:
        precision = f" under {self.settings.autocast} autocast" if self.settings.autocast else ""
        return f"{self.target.dimension} {size}{precision}"

    def graph(self, size: int) -> tuple[ActivationGraph, str]:
        """The graph at `size` and how it was obtained (CAPTURED or RESCALED)."""
        if size in self.samples:
            return self.samples[size]
        fit_sizes = [candidate for candidate in self.candidates if candidate >= SMALLEST_FIT_SIZE]
        if not self._fit_tried and fit_sizes and size >= fit_sizes[0]:
            self._fit(fit_sizes)
            if size in self.samples:
                return self.samples[size]
        if self.family is not None and size >= self.family.sizes[0]:
            rescaled = self.family.graph_at(size)
            if rescaled is not None:
                self.samples[size] = (rescaled, RESCALED)
                self.progress.tick(f"{self._label(size)}: rescaled")
                return self.samples[size]
        return self._capture(size)

    def _capture(self, size: int) -> tuple[ActivationGraph, str]:
        graph = _profile_size(self.target.call(size), self.settings)
        self.samples[size] = (graph, CAPTURED)
        self.progress.tick(f"{self._label(size)}: captured")
        return self.samples[size]

    def _fit(self, fit_sizes: list[int]) -> None:
        """Fit a family on the smallest sizes >= 2 and check it against the largest candidate."""
        self._fit_tried = True
        if len(fit_sizes) < FIT_SIZES + 1:
            self.reuse_note = (
                f"captures not reused: rescaling needs {FIT_SIZES + 1} sizes >= {SMALLEST_FIT_SIZE} "
                f"to fit and check, the search has {len(fit_sizes)}"
            )
            return
        if self.settings.cost_model != CostModel.ANALYTIC or self.settings.device is None:
            self.reuse_note = "captures not reused: times are measured, and measured times do not rescale"
            return
        spec = device_spec(self.settings.device)
        try:
            family = GraphFamily.fit({size: self._capture(size)[0] for size in fit_sizes[:FIT_SIZES]}, spec)
        except NotRescalable as error:
            self.reuse_note = f"captures not reused: {error}"
            return
        check_size = fit_sizes[-1]
        mismatch = family.mismatch(check_size, self._capture(check_size)[0])
        if mismatch is not None:
            self.reuse_note = f"captures not reused: {mismatch}"
            return
        self.family = family

    def confirm(self, size: int) -> bool:
        """Capture a rescaled size. True when it equals its rescaled graph (or was captured already);
        otherwise the family is dropped with every graph it gave."""
        _, source = self.graph(size)
        if source == CAPTURED:
            return True
        assert self.family is not None
        del self.samples[size]
        captured, _ = self._capture(size)
        mismatch = self.family.mismatch(size, captured)
        if mismatch is None:
            return True
        log.warning("dropping rescaled graphs: %s", mismatch)
        self.family = None
        self.reuse_note = f"captures not reused: {mismatch}"
        self.samples = {size: sample for size, sample in self.samples.items() if sample[1] == CAPTURED}
        return False


def _expected_graphs(candidates: Sequence[int], *, scan: bool, reuse: bool) -> int:
    """About how many graphs a search obtains, for the progress bar."""
    if scan:
        return len(candidates)
    bisection = 2 + math.ceil(math.log2(max(len(candidates), 1)))
    return min(len(candidates), 2 * bisection) + (FIT_SIZES + 3 if reuse else 0)


@dataclass(frozen=True)
class _Answer:
    """What one search for one budget found."""

    largest_without: int | None
    largest_with: int | None
    probed: tuple[int, ...]


class _Search:
    """Rows, plans and answers for one model over one set of candidate sizes, for any budget."""

    def __init__(
        self,
        target: _Target,
        settings: _Settings,
        *,
        candidates: tuple[int, ...],
        scan: bool,
        reuse: bool,
        progress: _Progress,
    ) -> None:
        self.target = target
        self.settings = settings
        self.candidates = candidates
        self.scan = scan
        self.reuse = reuse
        self.progress = progress
        self.probers: dict[torch.dtype | None, _Prober] = {}
        self._rows: dict[tuple[torch.dtype | None, int, int], tuple[ActivationGraph, SizeRow]] = {}
        self._plans: dict[
            tuple[torch.dtype | None, int, int, int], tuple[ActivationGraph, SimulationResult]
        ] = {}

    def prober(self, autocast: torch.dtype | None) -> _Prober:
        if autocast not in self.probers:
            settings = dataclasses.replace(self.settings, autocast=autocast)
            self.probers[autocast] = _Prober(
                self.target, settings, candidates=self.candidates, reuse=self.reuse, progress=self.progress
            )
        return self.probers[autocast]

    def _stepped(self, size: int, steps: int, autocast: torch.dtype | None) -> tuple[ActivationGraph, str]:
        graph, source = self.prober(autocast).graph(size)
        return for_training_step(
            graph, dataclasses.replace(self.settings.step, accumulation_steps=steps)
        ), source

    def row(self, size: int, *, steps: int | None = None, autocast: torch.dtype | None = None) -> SizeRow:
        """Peaks at `size` for the step with `steps` micro-batches (default: the step as given)."""
        steps = self.settings.step.accumulation_steps if steps is None else steps
        graph, source = self.prober(autocast).graph(size)
        cached = self._rows.get((autocast, size, steps))
        if cached is not None and cached[0] is graph:
            return cached[1]
        stepped, _ = self._stepped(size, steps, autocast)
        baseline = simulate(stepped, store_everything(stepped))
        _, lowest = lowest_peak(stepped)
        row = SizeRow(size, baseline.peak_bytes, lowest.peak_bytes, baseline.step_ms, source)
        self._rows[autocast, size, steps] = (graph, row)
        return row

    def best_plan(
        self, size: int, *, budget_bytes: int, steps: int, autocast: torch.dtype | None
    ) -> SimulationResult:
        """The solver's plan at `budget_bytes`, simulated (the row's lowest peak must fit it)."""
        graph, _ = self.prober(autocast).graph(size)
        key = (autocast, size, steps, budget_bytes)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is graph:
            return cached[1]
        stepped, _ = self._stepped(size, steps, autocast)
        result = simulate(stepped, solve(stepped, budget_bytes=budget_bytes, solver=self.settings.solver))
        self._plans[key] = (graph, result)
        return result

    def _search_once(self, budget_bytes: int) -> _Answer:
        probed: list[int] = []

        def fits(peak: Callable[[SizeRow], int]) -> Callable[[int], bool]:
            def check(size: int) -> bool:
                probed.append(size)
                return peak(self.row(size, autocast=self.settings.autocast)) <= budget_bytes

            return check

        without = largest_fitting(self.candidates, fits(lambda row: row.baseline_peak_bytes), scan=self.scan)
        start = self.candidates.index(without) if without is not None else 0
        with_plan = largest_fitting(
            self.candidates[start:], fits(lambda row: row.min_peak_bytes), scan=self.scan
        )
        return _Answer(without, with_plan, tuple(sorted(set(probed))))

    def answer(self, budget_bytes: int) -> _Answer:
        """The largest sizes that fit, each confirmed by a capture at that size (see the docstring)."""
        prober = self.prober(self.settings.autocast)
        while True:
            found = self._search_once(budget_bytes)
            answers = [size for size in (found.largest_without, found.largest_with) if size is not None]
            if all(prober.confirm(size) for size in answers):
                return found

    def plan(self, size: int, budget_bytes: int) -> Plan:
        """`planner.optimize` at `size`: a fresh capture and the plan with its module."""
        call = self.target.call(size)
        with _autocast(call, self.settings.autocast):
            return optimize(
                call.model,
                call.args,
                example_kwargs=call.kwargs,
                budget_bytes=budget_bytes,
                solver=self.settings.solver,
                **self.settings.step_options(),
            )

    def price(self, autocast: torch.dtype | None, budget_bytes: int) -> Price:
        """The cost of each option of NOTE [weighing options] in one precision."""

        def priced(micro_batch: int, steps: int, checkpointing: bool) -> Priced:
            row = self.row(micro_batch, steps=steps, autocast=autocast)
            if not checkpointing:
                fits = row.baseline_peak_bytes <= budget_bytes
                return Priced(row.baseline_peak_bytes, fits, row.step_ms, 0.0)
            if row.min_peak_bytes > budget_bytes:
                return Priced(row.min_peak_bytes, False, row.step_ms, 0.0)
            result = self.best_plan(micro_batch, budget_bytes=budget_bytes, steps=steps, autocast=autocast)
            return Priced(result.peak_bytes, True, row.step_ms, result.recompute_ms)

        return priced

    def weigh(self, global_batch: int, budget_bytes: int, where: str) -> Weighing:
        prices = {"": self.price(self.settings.autocast, budget_bytes)}
        notes = []
        if self.settings.autocast is None:
            if self.target.on_meta(self.candidates[0]):
                notes.append(
                    "bf16 autocast not weighed: torch.autocast does not act on meta tensors (weigh it on "
                    "real tensors, or build the model in bf16 to plan pure bf16 training)"
                )
            else:
                prices[BF16] = self.price(torch.bfloat16, budget_bytes)
        timing = self.prober(self.settings.autocast).graph(self.candidates[0])[0].timing
        if timing.startswith(CostModel.ANALYTIC):
            notes.append(
                f"times: {timing}, which prices every matmul at the device's one peak rate whatever its "
                "dtype, so bf16's gain is only in the bytes it moves"
            )
        else:
            notes.append(f"times: {timing} on this machine, per node, fastest of the profiling runs")
        return weigh(global_batch, prices, budget_bytes=budget_bytes, where=where, notes=notes)


@dataclass(frozen=True)
class Capacity:
    """How far the training step goes on one budget: the probed sizes and the largest that fit.

    Every figure is predicted. `plan()` gives the plan at the largest size that fits with checkpointing
    (to measure it, or to train with it); `at_budget` and `largest_for` answer for another budget from
    the same graphs; `plot` draws the largest size against card memory.
    """

    dimension: str
    fixed: Mapping[str, int]
    candidates: tuple[int, ...]
    budget_bytes: int
    card: str | None
    """The named card whose memory or rates the table is for (None for a bare budget)."""
    held_back_bytes: int
    """Of the card's memory, what `budget_bytes` leaves out for the CUDA context and cuBLAS workspaces
    (NOTE [held back] in profiler/cost_model.py); 0 for a budget given by hand."""
    rows: tuple[SizeRow, ...]
    """Every size the search probed for this budget, smallest first."""
    largest_without: int | None
    """Largest size whose step fits without checkpointing (None: not even the smallest)."""
    largest_with: int | None
    """Largest size whose lowest achievable peak fits (None: not even the smallest)."""
    peak_at_largest: int | None
    """Predicted peak of the solver's plan at `largest_with`."""
    overhead_at_largest: float | None
    """Predicted recompute of that plan over the step without checkpointing (0 when nothing is)."""
    timing: str
    notes: tuple[str, ...]
    weighing: Weighing | None
    _search: _Search = field(repr=False, compare=False)

    @property
    def where(self) -> str:
        """Where the table holds, for sentences: 'on a100-40gb' or 'within 40.00 GiB'."""
        return f"on {self.card}" if self.card else f"within {format_bytes(self.budget_bytes)}"

    def row(self, size: int, *, accumulation_steps: int | None = None) -> SizeRow:
        """The predicted peaks at any size (probing it if the search did not), for the training step
        as given or with `accumulation_steps` micro-batches of that size."""
        return self._search.row(size, steps=accumulation_steps, autocast=self._search.settings.autocast)

    def plan(self) -> Plan:
        """The plan at the largest size that fits with checkpointing, made by `planner.optimize` on a
        fresh capture at that size (its `module` is the checkpointed model for that size)."""
        if self.largest_with is None:
            raise ValueError(
                f"nothing fits {self.where}: at {self.dimension} {self.candidates[0]} the lowest achievable "
                f"peak is {format_bytes(self.row(self.candidates[0]).min_peak_bytes)}"
            )
        return self._search.plan(self.largest_with, self.budget_bytes)

    def largest_for(self, budget_bytes: int) -> tuple[int | None, int | None]:
        """(largest size without, with checkpointing) on another budget, from the same graphs."""
        found = self._search.answer(budget_bytes)
        return found.largest_without, found.largest_with

    def at_budget(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        global_batch: int | None = None,
    ) -> Capacity:
        """The table for another budget, from the same graphs (captures only where needed). Times stay
        those of this table's device."""
        return _table(
            self._search,
            budget_bytes_of(budget_gb, budget_bytes),
            None,
            global_batch=global_batch,
            fixed=self.fixed,
        )

    def plot(
        self, path: str | Path, *, memories_gib: Sequence[float] = CARD_MEMORIES_GIB, title: str | None = None
    ) -> Path:
        """Save the largest size against card memory, with and without checkpointing (needs matplotlib)."""
        from planner.report.plots import plot_capacity

        points = [(int(gib * 2**30), *self.largest_for(int(gib * 2**30))) for gib in memories_gib]
        return plot_capacity(
            points, path, dimension=self.dimension, top=self.candidates[-1], title=title or self._title()
        )

    def _title(self) -> str:
        fixed = ", ".join(f"{name} {value}" for name, value in self.fixed.items())
        return f"Largest {self.dimension}" + (f" at {fixed}" if fixed else "")

    def summary(self) -> str:
        return render_capacity(self)

    def __str__(self) -> str:
        return render_capacity(self)

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "dimension": self.dimension,
            "fixed": dict(self.fixed),
            "searched": {
                "first": self.candidates[0],
                "last": self.candidates[-1],
                "count": len(self.candidates),
                "search": "scan" if self._search.scan else "bisect",
            },
            "budget_bytes": self.budget_bytes,
            "card": self.card,
            "held_back_bytes": self.held_back_bytes,
            "timing": self.timing,
            "largest_without": self.largest_without,
            "largest_with": self.largest_with,
            "peak_at_largest_bytes": self.peak_at_largest,
            "overhead_at_largest": self.overhead_at_largest,
            "rows": [dataclasses.asdict(row) for row in self.rows],
            "notes": list(self.notes),
        }
        if self.weighing is not None:
            document["weighing"] = {
                "global_batch": self.weighing.global_batch,
                "recommendation": self.weighing.recommendation,
                "options": [
                    {
                        "option": option.describe(),
                        "micro_batch": option.micro_batch,
                        "accumulation_steps": option.accumulation_steps,
                        "checkpointing": option.checkpointing,
                        "precision": option.precision or "as built",
                        "fits": option.priced.fits,
                        "peak_bytes": option.priced.peak_bytes,
                        "step_ms": option.step_ms,
                        "samples_per_s": option.samples_per_s if option.priced.fits else None,
                    }
                    for option in self.weighing.options
                ],
                "notes": list(self.weighing.notes),
            }
        return document


def _describe_candidates(candidates: Sequence[int]) -> str:
    if len(candidates) > 2:
        gaps = {later - earlier for earlier, later in zip(candidates, candidates[1:], strict=False)}
        if len(gaps) == 1:
            gap = gaps.pop()
            return f"{candidates[0]}..{candidates[-1]}" + (f" step {gap}" if gap != 1 else "")
    return ", ".join(str(size) for size in candidates)


def _held_back_note(table: Capacity) -> str:
    if not table.held_back_bytes:
        return ""
    held_back = format_bytes(table.held_back_bytes)
    return f" usable: {held_back} held back for the CUDA context and cuBLAS workspaces"


def render_capacity(table: Capacity) -> str:
    """The table as text: answers first, then the probed sizes, notes and the weighing."""
    fixed = ", ".join(f"{name} {value}" for name, value in table.fixed.items())
    lines = [
        f"capacity {table.where}"
        + (f" ({format_bytes(table.budget_bytes)}{_held_back_note(table)})" if table.card else "")
        + f": {table.dimension} {_describe_candidates(table.candidates)}"
        + (f", {fixed}" if fixed else ""),
        f"  every figure is predicted (per-node times {table.timing}); memory as `optimize` counts it",
    ]
    width = len(f"largest {table.dimension} without checkpointing")
    rows = {row.size: row for row in table.rows}
    smallest = table.row(table.candidates[0])
    if table.largest_without is None:
        without = f"none (at {smallest.size}: {format_bytes(smallest.baseline_peak_bytes)})"
    else:
        peak = format_bytes(rows[table.largest_without].baseline_peak_bytes)
        without = f"{table.largest_without}  (peak {peak})"
    lines.append(f"  {'largest ' + table.dimension + ' without checkpointing':<{width}}  {without}")
    if table.largest_with is None:
        lowest = format_bytes(smallest.min_peak_bytes)
        with_plan = f"none (at {smallest.size} the lowest achievable peak is {lowest})"
    else:
        assert table.peak_at_largest is not None and table.overhead_at_largest is not None
        with_plan = (
            f"{table.largest_with}  (plan's peak {format_bytes(table.peak_at_largest)}, recompute "
            f"{table.overhead_at_largest:.1%} of the step)"
        )
    lines.append(f"  {'largest ' + table.dimension + ' with checkpointing':<{width}}  {with_plan}")
    lines += [
        "  " + line
        for line in render_rows(table.rows, dimension=table.dimension, budget_bytes=table.budget_bytes)
    ]
    lines += [f"  note: {note}" for note in table.notes]
    if table.weighing is not None:
        lines += ["  " + line for line in render_weighing(table.weighing)]
    return "\n".join(lines)


def _resolve_budget(
    device: str | DeviceSpec | None, budget_gb: float | None, budget_bytes: int | None
) -> tuple[int, str | None, int]:
    """(budget in bytes, the card's name or None, bytes of the card held back): an explicit budget, else
    the named card's memory less its CUDA context and library workspaces (NOTE [held back] in
    profiler/cost_model.py)."""
    if budget_gb is not None or budget_bytes is not None:
        budget = budget_bytes_of(budget_gb, budget_bytes)
        return budget, device_spec(device).name if device is not None else None, 0
    if device is None:
        raise ValueError(
            "give a card with its memory (device='a100-40gb', 'h100-80gb', 'rtx4090', or a "
            "DeviceSpec with memory_bytes) or a budget (budget_gb=... or budget_bytes=...; --budget on the "
            "command line)"
        )
    spec = device_spec(device)
    if spec.memory_bytes is None:
        raise ValueError(
            f"device {spec.name!r} does not say how much memory it has; name a card with its memory "
            "('a100-40gb', 'a100-80gb', 'h100-80gb', 'l40s', 'rtx4090') or give a budget (budget_gb=...; "
            "--budget on the command line)"
        )
    usable = spec.usable_memory_bytes
    assert usable is not None
    return usable, spec.name, spec.held_back_bytes


def _sizes(name: str, value: SizeSpec) -> tuple[int, ...] | int | None:
    """A dimension's argument: sorted candidate sizes (searched), an int (fixed) or None (absent)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | range | list | tuple):
        raise TypeError(
            f"{name} must be an int (fixed), a range or a list of sizes (searched), got {value!r}"
        )
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{name}={value} must be positive")
        return value
    sizes = sorted(set(value))
    if not sizes or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in sizes):
        raise ValueError(f"{name} must hold positive int sizes to search, got {value!r}")
    return tuple(sizes)


def _dimensions(batch: SizeSpec, sequence: SizeSpec) -> tuple[str, tuple[int, ...], dict[str, int]]:
    """(searched dimension, its candidates, the fixed dimensions)."""
    given = {name: _sizes(name, value) for name, value in (("batch", batch), ("sequence", sequence))}
    searched = {name: value for name, value in given.items() if isinstance(value, tuple)}
    if len(searched) != 1:
        raise ValueError(
            "search exactly one of batch= or sequence= (a range or a list of sizes); fix the other with "
            f"an int if make_inputs takes it; got batch={batch!r}, sequence={sequence!r}"
        )
    ((dimension, candidates),) = searched.items()
    fixed = {name: value for name, value in given.items() if isinstance(value, int)}
    return dimension, candidates, fixed


def _table(
    search: _Search,
    budget_bytes: int,
    card: str | None,
    *,
    global_batch: int | None,
    fixed: Mapping[str, int],
) -> Capacity:
    found = search.answer(budget_bytes)
    autocast = search.settings.autocast
    rows = tuple(search.row(size, autocast=autocast) for size in found.probed)
    peak = overhead = None
    if found.largest_with is not None:
        steps = search.settings.step.accumulation_steps
        result = search.best_plan(
            found.largest_with, budget_bytes=budget_bytes, steps=steps, autocast=autocast
        )
        peak, overhead = result.peak_bytes, result.overhead
    notes = []
    prober = search.prober(autocast)
    if prober.reuse_note:
        notes.append(prober.reuse_note)
    elif prober.family is not None and any(row.source == RESCALED for row in rows):
        sizes = ", ".join(str(size) for size in prober.family.sizes)
        notes.append(
            f"graphs marked rescaled come from captures at {search.target.dimension} {sizes} (rescale.py)"
        )
    inversion = check_monotone(rows, search.target.dimension)
    if inversion:
        notes.append(inversion)
    if found.largest_with == search.candidates[-1]:
        notes.append(f"the largest {search.target.dimension} searched fits: search higher to find the limit")
    weighing = None
    if global_batch is not None:
        if search.target.dimension != "batch":
            raise ValueError("global_batch weighs micro-batches: search batch=..., not sequence=...")
        where = f"on {card}" if card else f"within {format_bytes(budget_bytes)}"
        weighing = search.weigh(global_batch, budget_bytes, where)
    return Capacity(
        dimension=search.target.dimension,
        fixed=dict(fixed),
        candidates=search.candidates,
        budget_bytes=budget_bytes,
        card=card,
        held_back_bytes=0,
        rows=rows,
        largest_without=found.largest_without,
        largest_with=found.largest_with,
        peak_at_largest=peak,
        overhead_at_largest=overhead,
        timing=prober.graph(search.candidates[0])[0].timing,
        notes=tuple(notes),
        weighing=weighing,
        _search=search,
    )


def capacity(
    model: torch.nn.Module | Callable[..., Any],
    make_inputs: Callable[..., Any] | None = None,
    *,
    batch: SizeSpec = None,
    sequence: SizeSpec = None,
    device: str | DeviceSpec | None = None,
    budget_gb: float | None = None,
    budget_bytes: int | None = None,
    optimizer: OptimizerSpec = "adam",
    autocast: torch.dtype | None = None,
    step: TrainingStep | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    cost_model: str | None = None,
    solver: str = "auto",
    global_batch: int | None = None,
    search: str = "bisect",
    reuse_captures: bool | None = None,
    progress: ProgressCallback | None = None,
    memory_counting: str = "blocks",
) -> Capacity:
    """The largest batch or sequence whose training step fits, with and without checkpointing.

    `make_inputs(batch=..., sequence=...)` builds one micro-batch's example inputs (a tensor, a tuple
    of positional inputs or a dict of keyword inputs), called with the dimensions given here: search
    one (`batch=range(1, 513)` or a list of sizes) and fix the other with an int if it takes it.
    `model` is a module, or a factory called with the same keywords (for a model whose buffers follow
    the sequence length); without `make_inputs`, a factory returning `(model, example_inputs)`, as
    `planner plan`'s MODULE:FACTORY does (`planner.zoo.build_model` with `batch=`/`sequence=`).
    The budget is `budget_gb`/`budget_bytes`, else the memory of the named card (`device="a100-40gb"`,
    `"h100-80gb"`, `"rtx4090"`, or a `DeviceSpec` with `memory_bytes`).

    Costs are analytic on `device` when one is named (the only choice for a model on the meta
    device), else measured on this machine (`cost_model` overrides). `autocast=torch.bfloat16` plans
    the step under `torch.autocast` (not on the meta device). `step` is the training step as
    `optimize` takes it. `global_batch=G` also weighs checkpointing, accumulation and bf16 autocast
    for G samples per optimizer step (NOTE [weighing options] in fitting.py). `search="scan"` probes
    every size instead of bisecting (NOTE [monotone peaks]); `reuse_captures` (default: with analytic
    costs) rescales graphs instead of capturing every size (rescale.py). `progress(done, expected,
    message)` is called after each graph. Bytes count as `optimize` counts them (`memory_counting`).
    """
    dimension, candidates, fixed = _dimensions(batch, sequence)
    budget, card, held_back = _resolve_budget(device, budget_gb, budget_bytes)
    if search not in ("bisect", "scan"):
        raise ValueError(f"search={search!r} is not known; use 'bisect' or 'scan'")
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast must be torch.bfloat16, torch.float16 or None, got {autocast!r}")
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise TypeError(f"model must be a torch.nn.Module or a factory of one, got {type(model).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer) and not isinstance(model, torch.nn.Module):
        raise TypeError(
            "an optimizer instance belongs to one model's parameters; with a model factory pass the "
            "optimizer's name (e.g. optimizer='adamw')"
        )
    if make_inputs is not None and not callable(make_inputs):
        raise TypeError(f"make_inputs must be a function of the sizes, got {type(make_inputs).__name__}")
    if make_inputs is None and isinstance(model, torch.nn.Module):
        raise TypeError("give make_inputs(**sizes) -> example inputs with a model (or pass a factory)")
    chosen_cost_model = cost_model or (CostModel.ANALYTIC if device is not None else CostModel.MEASURED)
    reuse = chosen_cost_model == CostModel.ANALYTIC if reuse_captures is None else reuse_captures
    settings = _Settings(
        optimizer=optimizer,
        step=training_step_of(step),
        loss_fn=loss_fn,
        cost_model=chosen_cost_model,
        device=device,
        autocast=autocast,
        solver=solver,
        memory_counting=memory_counting_of(memory_counting),
    )
    scan = search == "scan"
    searcher = _Search(
        _Target(model, make_inputs, dimension, fixed),
        settings,
        candidates=candidates,
        scan=scan,
        reuse=reuse,
        progress=_Progress(progress, _expected_graphs(candidates, scan=scan, reuse=reuse)),
    )
    table = _table(searcher, budget, card, global_batch=global_batch, fixed=fixed)
    return dataclasses.replace(table, held_back_bytes=held_back)
