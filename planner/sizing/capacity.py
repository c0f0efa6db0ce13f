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

The table and the call are here: `capacity` checks its arguments and resolves the budget, `Capacity`
holds the answers and renders them. How a table is computed is search.py's (the graphs at each size,
captured or rescaled, and the answers for a budget); fitting.py has the bisection and the weighing,
rescale.py the reused captures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from planner.errors import format_bytes
from planner.ir import CostModel, MemoryCounting, TrainingStep
from planner.planning.arguments import budget_bytes_of, cost_model_of, memory_counting_of, training_step_of
from planner.planning.plan import Plan
from planner.profiler.cost_model import DeviceSpec, device_spec
from planner.profiler.measurement import OptimizerSpec
from planner.sizing.fitting import SizeRow, Weighing, check_monotone, render_rows, render_weighing
from planner.sizing.search import (
    RESCALED,
    Progress,
    ProgressCallback,
    Search,
    Settings,
    Target,
    expected_graphs,
)

__all__ = ["PLOTTED_CARDS", "Capacity", "capacity"]

DIMENSIONS = ("batch", "sequence")
PLOTTED_CARDS = ("rtx4090", "a100-40gb", "l40s", "a100-80gb", "h100-80gb")
"""The named cards the capacity plot compares, each at the budget `device=card` plans against."""

SizeSpec = int | range | Sequence[int] | None
"""A searched dimension (a range or sorted sizes), a fixed one (an int), or absent (None)."""


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
    _search: Search = field(repr=False, compare=False)

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
        self,
        path: str | Path,
        *,
        cards: Sequence[str | DeviceSpec] = PLOTTED_CARDS,
        title: str | None = None,
    ) -> Path:
        """Save the largest size on each card, with and without checkpointing (needs matplotlib); a card
        counts at its memory less what it holds back, as `device=card` plans (NOTE [held back])."""
        from planner.report.plots import plot_capacity

        points = [_card_point(device_spec(card), self.largest_for) for card in cards]
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


def _card_point(
    spec: DeviceSpec, largest_for: Callable[[int], tuple[int | None, int | None]]
) -> tuple[str, int | None, int | None]:
    """A capacity plot's bar pair for one card: its label (name and budget) and the largest sizes."""
    usable = spec.usable_memory_bytes
    if usable is None:
        raise ValueError(
            f"card {spec.name!r} does not say how much memory it has; plot named cards with their memory "
            f"({', '.join(PLOTTED_CARDS)}) or a DeviceSpec with memory_bytes"
        )
    return (f"{spec.name}\n{format_bytes(usable)}", *largest_for(usable))


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
    search: Search,
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
    cost_model: CostModel | str | None = None,
    solver: str = "auto",
    global_batch: int | None = None,
    search: str = "bisect",
    reuse_captures: bool | None = None,
    progress: ProgressCallback | None = None,
    memory_counting: MemoryCounting | str = MemoryCounting.BLOCKS,
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
    default_cost_model = CostModel.ANALYTIC if device is not None else CostModel.MEASURED
    chosen_cost_model = default_cost_model if cost_model is None else cost_model_of(cost_model)
    reuse = chosen_cost_model is CostModel.ANALYTIC if reuse_captures is None else reuse_captures
    settings = Settings(
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
    searcher = Search(
        Target(model, make_inputs, dimension, fixed),
        settings,
        candidates=candidates,
        scan=scan,
        reuse=reuse,
        progress=Progress(progress, expected_graphs(candidates, scan=scan, reuse=reuse)),
    )
    table = _table(searcher, budget, card, global_batch=global_batch, fixed=fixed)
    return dataclasses.replace(table, held_back_bytes=held_back)
