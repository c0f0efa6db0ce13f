"""The size search behind `planner.capacity`: a graph at each size the search probes, captured or rescaled,
and for any budget the largest sizes that fit, with the rows, plans and prices a table is made of.

Why it exists: capacity.py is the call and what it returns, `Capacity` and its text and JSON form, while
what a table is computed from, and computed again for another budget (`Capacity.at_budget`,
`largest_for`), is a search that holds its captures between questions. That search is the torch side of
the stage: it builds the model and inputs at each size, profiles them and remembers the graphs;
fitting.py bisects and weighs on the numbers it gets, and rescale.py rescales the graphs it captured.

How it works:
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
from typing import Any

import torch

from planner.ir import ActivationGraph, CostModel, MemoryCounting, SimulationResult, TrainingStep
from planner.one_call import optimize
from planner.planning.model import profile
from planner.planning.plan import Plan
from planner.profiler.cost_model import DeviceSpec, device_spec
from planner.profiler.counting import tensors_in
from planner.profiler.measurement import OptimizerSpec
from planner.simulation.micro_batches import for_training_step
from planner.simulation.step import simulate, store_everything
from planner.sizing.fitting import Price, Priced, SizeRow, Weighing, largest_fitting, weigh
from planner.sizing.rescale import FIT_SIZES, GraphFamily, NotRescalable
from planner.solvers import lowest_peak, solve

__all__ = [
    "CAPTURED",
    "RESCALED",
    "ProgressCallback",
    "Progress",
    "Search",
    "Settings",
    "Target",
    "expected_graphs",
]

log = logging.getLogger(__name__)

CAPTURED, RESCALED = "captured", "rescaled"
SMALLEST_FIT_SIZE = 2
"""Rescaling is fitted from sizes of at least 2: a dimension of size 1 may be specialised away (a
squeezed or broadcast dimension), so the graph at 1 need not be the graph at 2 rescaled."""
BF16 = "bf16 autocast"

ProgressCallback = Callable[[int, int, str], None]
"""(graphs obtained so far, graphs expected, what the last one was): for a progress bar. The expected
count is an estimate and may grow."""


@dataclass(frozen=True)
class Settings:
    """What every capture of one configuration shares."""

    optimizer: OptimizerSpec
    step: TrainingStep
    loss_fn: Callable[[Any], torch.Tensor] | None
    cost_model: CostModel
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
class Target:
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


def _profile_size(call: _Call, settings: Settings) -> ActivationGraph:
    """The activation graph of one micro-batch at one size, as profiled (before the training step's
    accumulation is applied): the one call into the profiling pipeline (`planner.profile`)."""
    with _autocast(call, settings.autocast):
        profiled = profile(call.model, call.args, example_kwargs=call.kwargs, **settings.step_options())
    return profiled.profiled_graph


class Progress:
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
        target: Target,
        settings: Settings,
        *,
        candidates: Sequence[int],
        reuse: bool,
        progress: Progress,
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


def expected_graphs(candidates: Sequence[int], *, scan: bool, reuse: bool) -> int:
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


class Search:
    """Rows, plans and answers for one model over one set of candidate sizes, for any budget."""

    def __init__(
        self,
        target: Target,
        settings: Settings,
        *,
        candidates: tuple[int, ...],
        scan: bool,
        reuse: bool,
        progress: Progress,
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
