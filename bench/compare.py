"""Side-by-side benchmark: our plans against the checkpointing users pick today, measured in one run.

Why it exists: the planner claims "fits the budget, with the least recompute". That claim holds only if
it is measured beside what users would otherwise do, on the same machine, in the same run. Per model
(GPT-2-, BERT- and Llama-style transformers, a ViT, ResNet-, DenseNet- and U-Net-style CNNs from
`planner.testing.zoo_real`, and the seed models of `planner.zoo.FIDELITY_ZOO`), each in a process of its
own so that compiled code and memory do not leak from one model into the next, it measures these rows:

eager
    no checkpointing; "sqrt(n) segments" (`checkpoint_sequential`) and "every block"
    (`gradient_checkpointing_enable`), built by bench/peers.py; our `dp` and `ilp` plans with each
    peer's measured peak as the budget.
compiled (`torch.compile`, inductor)
    `torch._functorch.config.activation_memory_budget` at several fractions (1.0 is compiled no
    checkpointing); our `dp` and `ilp` plans of the compiled step (`planner.optimize(..., compile=True)`,
    planner/compiled/optimize.py) with each fraction's measured peak as the budget. Both sides are
    compiled, so compile speed-ups bias neither.

For every row: the measured peak of two Adam training steps, whether it respected the budget it was
given, the step-time ratio against no checkpointing of the same mode (median over interleaved rounds,
bench/peers.py), and whether loss, gradients and buffers after one step under one seed (dropout
included) equal the unmodified model's: the eager model's for eager rows, compiled no checkpointing's
for compiled rows (NOTE [compiled gradients]).

Budgets: ours is given a byte budget (the peer's peak) and respects it when its measured peak is at most
that. A fraction of `activation_memory_budget` bounds the activations the compiled forward keeps for
backward, relative to the default partition; it is respected when the bytes still live after the
forward are at most that fraction of compiled no-checkpointing's (plus `KEPT_SLACK`). sqrt(n) segments
and every block take no budget.

NOTE [measuring compiled steps]: on the CPU `planner.measure` counts live tensor storages with a
TorchDispatchMode. Dynamo does not run compiled code while a dispatch mode is active: it runs the
frames eagerly, and keeps skipping them afterwards, so the tracker would report the *eager* peak of a
compiled module (and spoil the module for timing). Compiled rows therefore count the CPU allocator's own
events (`torch.profiler` with `profile_memory=True`: every allocation and free, inductor's buffers
included) on top of the bytes of parameters, buffers and inputs; a row notes when its step did not run
compiled code. The tracker's view is taken once per model at the very end, as `tracker_check`, to show
the difference. Eager rows use `planner.measure`, the currency our budgets are planned in; on the
eager no-checkpointing step both counts are recorded side by side. On a GPU every row uses the caching
allocator's statistics (`max_memory_allocated`), less the memory that other variants in the process hold.

NOTE [compiled gradients]: inductor draws dropout masks with its own generator, not eager's, so on a
model with dropout a compiled step's loss differs from the eager step's. Compiled rows are therefore
compared with compiled no checkpointing (same seed, so the same masks in the forward); compiled no
checkpointing is compared with the eager model where their losses agree. Inductor reorders reductions,
so float32 gradients differ by rounding, and by up to a few percent of a tensor whose true gradient is
~0 (a bias before BatchNorm): compiled rows pass when the loss and the gradient of the whole model agree
to `COMPILED_GRADIENT_RTOL` of its norm (`planner.testing.steps.gradient_error`).
(`torch._inductor.config.fallback_random` would draw eager's masks, but then a random op that the
partitioner recomputes draws a new mask: not what users run.)

NOTE [compiled budgets]: our compiled rows plan the compiled step itself, so a compiled peer's measured
peak P is their budget as it is, in the same currency (the allocator's bytes of the whole step). The
compiled step is read once without compiling (`plan_compiled_step`) and solved at every budget and
solver; rows whose schedules agree share one compilation (`CompiledPlans`).

NOTE [compile caches]: `activation_memory_budget` is not part of the FX-graph or AOT-autograd cache
keys, so both caches are switched off (`torch._inductor.config.fx_graph_cache`,
`torch._functorch.config.enable_autograd_cache`). Each compiled variant gets a backend of its own that
sets the fraction while it partitions; dynamo guards cache entries on the backend, so variants that are
timed side by side keep their own compiled code without `torch._dynamo.reset()` between them (reset
would throw away the variants compiled before). The C++ kernel cache of inductor is keyed by the
kernel's source and stays on: a later run reuses compiled kernels and compiles faster.

NOTE [log calls]: a log call inside a compiled forward splits the graph (dynamo cannot trace
`logging`), and Hugging Face's GPT-2 logs a one-time warning when it computes its loss
(`loss_type=None`). Every compiled variant is compiled with dynamo's `ignore_logger_methods` set to the
logging methods, so that the step is one graph for the peers and for our plans alike (planning the
compiled step needs one graph: NOTE [graph breaks] in planner/compiled/split_step.py); the warning then
shows only from eager runs.

Run from the repository root (two models at a time by default, `--jobs`; see `DEFAULT_JOBS`):

    .venv/bin/python -m bench.compare --quick      # 2 small models, 3 rounds, fractions 1.0 and 0.0
    .venv/bin/python -m bench.compare              # the whole zoo, 15+ rounds, fractions 1.0/0.5/0.2/0.0
    .venv/bin/python -m bench.compare --models gpt_tiny,hf_gpt2 --out /tmp/compare.json
    .venv/bin/python -m bench.compare --device cuda    # its own files: compare_cuda.{json,md,png}
    .venv/bin/python -m bench.compare --render bench/results/compare.json    # tables and plot again
    .venv/bin/python -m bench.compare --compiled-only --out /tmp/compiled.json  # compiled rows alone

Results: JSON at `--out` (default `bench/results/compare.json`, `compare_quick.json` with `--quick`), the
markdown tables (`.md`, also printed to stdout; verdicts and rendering live in bench/compare_report.py) and
the plot (`.png`: measured peak against step-time ratio, per model) beside it; writing the default results
(or `--render` of them) also rewrites the summary table docs/benchmark.md quotes (bench/docs_tables.py).
Models run longest first by the previous JSON's timings. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import planner
from bench.compare_report import (
    NO_CHECKPOINTING,
    SOLVERS,
    Family,
    Mode,
    ModelResult,
    Row,
    TrackerCheck,
    label,
    markdown,
    plot,
    result_from_dict,
)
from bench.docs_tables import refresh_quotes
from bench.peers import (
    EVERY_BLOCK,
    GRADIENT_RTOL,
    SQRT_SEGMENTS,
    Contender,
    contender,
    every_block_peer,
    interleaved_step_ms,
    machine,
    mib,
    paired_ratio,
    planner_revision,
    sqrt_segments_peer,
)
from planner import zoo
from planner.compiled.optimize import plan_compiled_step
from planner.compiled.step import log_methods as planner_log_methods
from planner.ir import TrainingStep
from planner.planning.graph import plan_graph
from planner.profiler.measurement import AllocatorPhases, default_loss, storage_bytes, tensors_in
from planner.testing.steps import (
    StepRecord,
    Variant,
    buffer_mismatch,
    copied_variant,
    gradient_error,
    gradient_mismatch,
    one_step,
    record_step,
    variant_of,
)
from planner.testing.zoo_real import ExampleCall, build_call

log = logging.getLogger("bench.compare")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
REPOSITORY = Path(__file__).resolve().parent.parent
"""Where the workers run `python -m bench.compare`."""
REAL_MODELS = ("hf_gpt2", "hf_bert", "hf_llama", "hf_vit", "resnet", "densenet", "unet")
MODELS = (*zoo.FIDELITY_ZOO, *REAL_MODELS)
QUICK_MODELS = ("seed000_mlp", "seed002_cifar10")
FRACTIONS = (1.0, 0.5, 0.2, 0.0)
QUICK_FRACTIONS = (1.0, 0.0)
NO_CHECKPOINTING_FRACTION = 1.0
"""activation_memory_budget=1.0 is the default partition: compiled no checkpointing."""
TIMING_ROUNDS = 15
"""Timing rounds at least, per model and mode (NOTE [timing noise] in bench/peers.py)."""
TIMING_S = 60.0
"""Seconds of timing per model and mode: a model whose rounds are quick gets more of them."""
MAX_TIMING_ROUNDS = 201
QUICK_TIMING_ROUNDS = 3
WARMUP_STEPS = 1
"""Untimed steps per variant first: one creates Adam's state; compiled variants already ran while measured."""
REFERENCE_BUDGET_BYTES = 2**40
"""A budget every plan fits: its plan reports the predicted lowest and no-checkpointing peaks."""
COMPILED_GRADIENT_RTOL = 1e-3
"""Inductor fuses and reorders reductions: a compiled step's loss and gradient norm match eager ones to
~1e-6 in float32 (to 1e-13 in float64, so the difference is rounding); another dropout mask changes the
gradient by tens of percent of its norm."""
COMPILED_BUFFER_RTOL = 1e-5
"""BatchNorm running statistics of a compiled step match eager ones to ~2e-6 of their scale, not bitwise."""
KEPT_SLACK = 0.02
"""Allowance, as a fraction of compiled no-checkpointing's kept bytes, before a fraction counts as missed."""
RECOMPILE_LIMIT = 64
"""Dynamo's cache entries per code object; every compiled variant of one model class needs its own."""
MODEL_TIMEOUT_S = 2400
"""A model that compiles many plans (DenseNet, gpt_tiny: up to seven compilations of 1-2 min each on a
loaded 2-core machine) takes 20 min or more; the limit only catches a hung worker."""
DEFAULT_JOBS = 2
"""Two models at a time, each with half the cores: most of a model's time is compiling and profiling,
which use one core, so two processes finish the zoo in about half the time. Each process times its own
variants in interleaved rounds, so the other process slows all of them alike."""
COMPILED_REGION_EVENT = "Torch-Compiled Region"
"""Profiler event name of a compiled frame: its absence means dynamo ran the step eagerly."""
BEFORE_FORWARD, FORWARD = "before forward", "forward"
"""Phases `allocator_step_memory` marks: the bytes kept after forward are the second's end less the
first's."""
DIFFERENT_MASKS = "not comparable: inductor draws other dropout masks than eager (NOTE [compiled gradients])"


@dataclass(frozen=True)
class Settings:
    device: str
    fractions: tuple[float, ...]
    rounds: int
    """Timing rounds at least; as many more as fit `timing_s` (at most `MAX_TIMING_ROUNDS`)."""
    timing_s: float
    quick: bool
    jobs: int
    """Models benchmarked at once, each in its own process with cpu_count / jobs torch threads."""
    compiled_only: bool = False
    """Measure the compiled rows alone (no eager peers and plans)."""


@dataclass
class Candidate:
    """A row and the variant it measures; rows of one plan share the variant (and its runner)."""

    row: Row
    variant: Variant


@dataclass(frozen=True)
class StepMemory:
    """Peak of two training steps, bytes still live after the second forward, and whether it ran compiled."""

    peak_bytes: int
    kept_after_forward_bytes: int | None
    ran_compiled: bool | None


def build_example(name: str, device: str) -> ExampleCall:
    """A zoo or real-zoo model and its example call, on `device`."""
    if name in zoo.ZOO:
        model, inputs = zoo.build_model(name)
        call = ExampleCall(model, inputs)
    else:
        call = build_call(name)
    return ExampleCall(
        call.model.to(device),
        tuple(value.to(device) if isinstance(value, torch.Tensor) else value for value in call.args),
        {
            key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in call.kwargs.items()
        },
    )


@contextlib.contextmanager
def compiler_settings() -> Iterator[None]:
    """NOTE [compile caches] and NOTE [log calls]."""
    torch._dynamo.reset()
    # one compile worker per torch thread: with --jobs, each model process has its share of the cores
    with (
        torch._inductor.config.patch(fx_graph_cache=False, compile_threads=torch.get_num_threads()),
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, ignore_logger_methods=log_methods()),
    ):
        yield


def log_methods() -> set[Callable[..., Any]]:
    """NOTE [log calls]: the logging methods dynamo skips instead of breaking the graph, as
    `optimize(..., compile=True)` skips them (transformers adds `warning_once` when it is imported, and
    the models are built after the compiler settings are entered)."""
    with contextlib.suppress(ImportError):
        import transformers  # noqa: F401
    return planner_log_methods()


def budget_backend(fraction: float) -> Callable[..., Any]:
    """An inductor backend, new on every call, that partitions with `activation_memory_budget=fraction`."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return compile_fx(graph_module, list(example_inputs))

    return backend


def compiled(variant: Variant, fraction: float) -> Variant:
    module = torch.compile(variant.module, backend=budget_backend(fraction))
    return Variant(module=module, parameters=variant.parameters, buffers=variant.buffers)  # type: ignore[arg-type]


def resident_tensors(module: torch.nn.Module, call: ExampleCall) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers(), *tensors_in((call.args, call.kwargs))]


def static_bytes(module: torch.nn.Module, call: ExampleCall) -> int:
    return storage_bytes(resident_tensors(module, call))


def train_two_steps(module: torch.nn.Module, call: ExampleCall, on_forward: Callable[[], Any]) -> None:
    """Two Adam steps as `planner.measure` runs them; `on_forward()` is a context around each forward."""
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        with on_forward():
            loss = default_loss(module(*call.args, **call.kwargs))
        loss.backward()
        del loss
        optimizer.step()


def allocator_step_memory(module: torch.nn.Module, call: ExampleCall) -> StepMemory:
    """CPU: the allocator's events over two steps (NOTE [measuring compiled steps]). Trains `module`."""
    module.zero_grad(set_to_none=True)
    with AllocatorPhases(resident_tensors(module, call)) as allocator:

        @contextlib.contextmanager
        def marked_forward() -> Iterator[None]:
            allocator.on_phase(BEFORE_FORWARD)
            yield
            allocator.on_phase(FORWARD)

        train_two_steps(module, call, marked_forward)
    return StepMemory(
        peak_bytes=max(allocator.peaks.values()),
        kept_after_forward_bytes=allocator.ends[FORWARD] - allocator.ends[BEFORE_FORWARD],
        ran_compiled=any(name.startswith(COMPILED_REGION_EVENT) for name in allocator.event_names),
    )


def cuda_step_memory(module: torch.nn.Module, call: ExampleCall) -> StepMemory:
    """GPU: allocator statistics over two steps, less what other variants in the process hold."""
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    others_bytes = torch.cuda.memory_allocated() - static_bytes(module, call)
    torch.cuda.reset_peak_memory_stats()
    kept: list[int] = []

    @contextlib.contextmanager
    def measured_forward() -> Iterator[None]:
        before_bytes = torch.cuda.memory_allocated()
        yield
        torch.cuda.synchronize()
        kept.append(torch.cuda.memory_allocated() - before_bytes)

    train_two_steps(module, call, measured_forward)
    torch.cuda.synchronize()
    return StepMemory(
        peak_bytes=torch.cuda.max_memory_allocated() - others_bytes,
        kept_after_forward_bytes=kept[-1],
        ran_compiled=None,
    )


def step_memory(module: torch.nn.Module, call: ExampleCall, mode: Mode) -> StepMemory:
    """The measured peak of a row in its currency (NOTE [measuring compiled steps]). Trains `module`."""
    if next(module.parameters()).is_cuda:
        return cuda_step_memory(module, call)
    if mode is Mode.COMPILED:
        return allocator_step_memory(module, call)
    measured = planner.measure(module, call.args, example_kwargs=call.kwargs)
    return StepMemory(peak_bytes=measured.peak_bytes, kept_after_forward_bytes=None, ran_compiled=None)


def check_gradients(row: Row, record: StepRecord, reference: StepRecord) -> None:
    """Eager rows: every gradient to `GRADIENT_RTOL` of its scale, buffers bitwise. Compiled rows: loss and
    the whole gradient to `COMPILED_GRADIENT_RTOL` (NOTE [compiled gradients]), buffers to
    `COMPILED_BUFFER_RTOL`."""
    row.gradient_error = gradient_error(reference, record)
    if row.mode is Mode.EAGER:
        row.gradient_mismatch = gradient_mismatch(reference, record, rtol=GRADIENT_RTOL)
        row.buffers_equal = buffer_mismatch(reference, record) is None
    else:
        row.gradient_mismatch = compiled_mismatch(record, reference, row.gradient_error)
        row.buffers_equal = buffer_mismatch(reference, record, rtol=COMPILED_BUFFER_RTOL) is None
    row.gradients_equal = row.gradient_mismatch is None


def compiled_mismatch(record: StepRecord, reference: StepRecord, error: float) -> str | None:
    if not torch.allclose(record.loss, reference.loss, rtol=COMPILED_GRADIENT_RTOL, atol=0.0):
        return f"loss {record.loss.item():.6g}, expected {reference.loss.item():.6g}"
    if error > COMPILED_GRADIENT_RTOL:
        return f"gradients differ by {error:.1e} of their norm"
    return None


def check_compiled_baseline(row: Row, record: StepRecord, eager: StepRecord) -> None:
    """Compiled no checkpointing against eager, unless inductor drew other dropout masks (NOTE [compiled
    gradients]): then the forward differs, and only the compiled rows can be compared, with this one."""
    if torch.allclose(record.loss, eager.loss, rtol=COMPILED_GRADIENT_RTOL, atol=0.0):
        check_gradients(row, record, eager)
    else:
        row.gradient_mismatch = DIFFERENT_MASKS


def measure_candidate(candidate: Candidate, call: ExampleCall, reference: StepRecord) -> StepRecord:
    """Gradients after one step (against `reference`), then the peak of two training steps.

    Eager variants are measured on copies. A compiled variant is measured in place (a copy would
    compile again): first the gradient step, then two Adam steps; it is timed after that.
    """
    row, variant = candidate.row, candidate.variant
    if row.mode is Mode.EAGER:
        record = one_step(variant, call.args, kwargs=call.kwargs)
        check_gradients(row, record, reference)
        memory = step_memory(copy.deepcopy(variant.module), call, row.mode)
    else:
        record = record_step(variant, call.args, kwargs=call.kwargs)
        if row.family is Family.BASELINE:
            check_compiled_baseline(row, record, reference)
        else:
            check_gradients(row, record, reference)
        memory = step_memory(variant.module, call, row.mode)
    row.peak_bytes, row.kept_after_forward_bytes = memory.peak_bytes, memory.kept_after_forward_bytes
    row.ran_compiled = memory.ran_compiled
    if row.budget_bytes is not None:
        row.within_budget = row.peak_bytes <= row.budget_bytes
    log.info(
        "  %s %s: peak %s MiB, gradients %s",
        row.mode,
        label(row),
        mib(row.peak_bytes),
        "equal" if row.gradients_equal else f"not equal ({row.gradient_mismatch})",
    )
    return record


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]


def optimize_at(call: ExampleCall, budget_bytes: int, solver: str) -> planner.Plan:
    return planner.optimize(
        call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget_bytes, solver=solver
    )


def our_row(peer: Row, solver: str) -> Row:
    assert peer.peak_bytes is not None
    return Row(
        method="ours", mode=peer.mode, family=Family.OURS, peer=label(peer), solver=solver,
        budget_bytes=peer.peak_bytes, planned_budget_bytes=peer.peak_bytes,
    )  # fmt: skip


@dataclass(frozen=True)
class PlannedVariant:
    """A plan's facts for its rows, and the variant that runs it."""

    predicted_peak_bytes: int
    checkpointed_regions: int
    infeasible_min_peak_bytes: int | None
    description: str
    variant: Variant


@dataclass(frozen=True)
class PredictedRange:
    """Our predicted lowest peak and no-checkpointing peak, from one reference `optimize` call whose
    profile every plan of the model reuses (`Plan.replan`): measured node times move between
    profiling runs, and one profile keeps dp and ilp comparable."""

    reference: planner.Plan

    @property
    def min_peak_bytes(self) -> int:
        return self.reference.min_peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.reference.baseline_peak_bytes


class OurPlans:
    """Our plans for one mode, made once per (solver, budget) and built once per schedule.

    Budgets at or above the predicted no-checkpointing peak need no `optimize` call: the plan
    checkpoints nothing, so its rows share the baseline's variant and measurements. Budgets below the
    predicted lowest peak are planned at that lowest peak (NOTE [infeasible at the peer's peak]).
    """

    def __init__(self, call: ExampleCall, none: Candidate, predicted: PredictedRange) -> None:
        self.call = call
        self.none = none
        self.predicted = predicted
        self.by_budget: dict[tuple[str, int], PlannedVariant] = {}
        self.by_schedule: dict[Any, Variant] = {(): none.variant}

    def planned(self, solver: str, budget_bytes: int) -> PlannedVariant:
        if budget_bytes >= self.predicted.baseline_peak_bytes:
            return PlannedVariant(
                predicted_peak_bytes=self.predicted.baseline_peak_bytes,
                checkpointed_regions=0,
                infeasible_min_peak_bytes=None,
                description="the budget fits no checkpointing: nothing to checkpoint",
                variant=self.none.variant,
            )
        # NOTE [infeasible at the peer's peak]: the row keeps the peer's budget (and says whether it fits);
        # the plan is made at the lowest budget the planner accepts, whose measured peak may still reach it.
        infeasible_min_peak_bytes = None
        if budget_bytes < self.predicted.min_peak_bytes:
            infeasible_min_peak_bytes = budget_bytes = self.predicted.min_peak_bytes
        key = (solver, budget_bytes)
        if key not in self.by_budget:
            plan = self.predicted.reference.replan(budget_bytes=budget_bytes, solver=solver)
            self.by_budget[key] = PlannedVariant(
                predicted_peak_bytes=plan.predicted_peak_bytes,
                checkpointed_regions=len(plan.regions),
                infeasible_min_peak_bytes=infeasible_min_peak_bytes,
                description=f"{len(plan.regions)} checkpointed regions, capture {plan.capture}",
                variant=self.variant(plan),
            )
        return self.by_budget[key]

    def variant(self, plan: planner.Plan) -> Variant:
        key = plan.schedule.checkpointed
        if key not in self.by_schedule:
            assert plan.module is not None
            model = self.call.model
            self.by_schedule[key] = dataclasses.replace(variant_of(model), module=plan.module)
        return self.by_schedule[key]


class CompiledPlans:
    """Our plans of the compiled step (NOTE [compiled budgets]): the step's graph read once without
    compiling, solved at each (solver, budget), and compiled once per distinct schedule, on a copy of the
    model. Budgets below the predicted lowest peak are planned at it (NOTE [infeasible at the peer's
    peak])."""

    def __init__(self, call: ExampleCall) -> None:
        self.call = call
        self.by_schedule: dict[Any, tuple[planner.Plan, Variant]] = {}

    @functools.cached_property
    def reference(self) -> planner.Plan:
        """The compiled step planned once without compiling (raises for a model it cannot plan)."""
        return plan_compiled_step(
            self.call.model, self.call.args, self.call.kwargs, budget_bytes=REFERENCE_BUDGET_BYTES,
            optimizer="adam", step=TrainingStep(), loss_fn=default_loss, solver="dp", device=None,
        )  # fmt: skip

    def planned(self, solver: str, budget_bytes: int) -> PlannedVariant:
        infeasible_min_peak_bytes = None
        if budget_bytes < self.reference.min_peak_bytes:
            infeasible_min_peak_bytes = budget_bytes = self.reference.min_peak_bytes
        schedule = plan_graph(self.reference.graph, budget_bytes=budget_bytes, solver=solver).schedule
        key = tuple((region.start, region.stop, region.keep) for region in schedule.checkpointed)
        if key not in self.by_schedule:
            copied = copied_variant(variant_of(self.call.model))
            plan = planner.optimize(
                copied.module, self.call.args, example_kwargs=self.call.kwargs, budget_bytes=budget_bytes,
                solver=solver, compile=True,
            )  # fmt: skip
            assert plan.module is not None and plan.compiled is not None
            log.info(
                "  compiled plan at %s MiB (%s): %.1f s, %d compilation(s)",
                mib(budget_bytes), solver, plan.compiled.compile_s, plan.compiled.attempts,
            )  # fmt: skip
            self.by_schedule[key] = (plan, Variant(plan.module, copied.parameters, copied.buffers))
        plan, variant = self.by_schedule[key]
        assert plan.compiled is not None
        return PlannedVariant(
            predicted_peak_bytes=plan.predicted_peak_bytes,
            checkpointed_regions=len(plan.regions),
            infeasible_min_peak_bytes=infeasible_min_peak_bytes,
            description=(
                f"{len(plan.regions)} checkpointed regions, compiled plan, {plan.compiled.attempts} "
                f"compilation(s), {plan.compiled.compile_s:.1f} s"
            ),
            variant=variant,
        )


def our_candidate(plans: OurPlans | CompiledPlans, row: Row) -> Candidate | None:
    """`row` with our plan at its planned budget, or None (and the row says why) when planning fails."""
    assert row.planned_budget_bytes is not None and row.solver is not None
    try:
        planned = plans.planned(row.solver, row.planned_budget_bytes)
    except Exception as error:  # one failed plan must not lose the model's other rows
        log.exception("  %s: planning failed", label(row))
        row.error = error_text(error)
        return None
    row.predicted_peak_bytes, row.checkpointed_regions = (
        planned.predicted_peak_bytes,
        planned.checkpointed_regions,
    )
    row.infeasible_min_peak_bytes, row.description = planned.infeasible_min_peak_bytes, planned.description
    return Candidate(row, planned.variant)


def our_candidates(
    plans: OurPlans | CompiledPlans, peers: Sequence[Candidate]
) -> tuple[list[Candidate], list[Row]]:
    """Our `dp` and `ilp` plans at each measured peer's peak, and the rows whose planning failed."""
    candidates, failed = [], []
    for peer in peers:
        if peer.row.peak_bytes is None:
            continue
        for solver in SOLVERS:
            row = our_row(peer.row, solver)
            candidate = our_candidate(plans, row)
            if candidate is None:
                failed.append(row)
            else:
                candidates.append(candidate)
    return candidates, failed


def copy_measurements(candidate: Candidate, first: Candidate) -> None:
    """Give a row whose variant another row already measured that row's measurements (its own budget)."""
    measured = (
        "peak_bytes", "kept_after_forward_bytes", "gradients_equal", "gradient_error", "gradient_mismatch",
        "buffers_equal", "ran_compiled", "error",
    )  # fmt: skip
    for name in measured:
        setattr(candidate.row, name, getattr(first.row, name))
    candidate.row.same_plan_as = label(first.row)
    if candidate.row.budget_bytes is not None and candidate.row.peak_bytes is not None:
        candidate.row.within_budget = candidate.row.peak_bytes <= candidate.row.budget_bytes


def measure_all(
    candidates: Sequence[Candidate],
    call: ExampleCall,
    reference: StepRecord,
    *,
    measured: Sequence[Candidate] = (),
) -> None:
    """Measure each distinct variant once; rows sharing a variant (also with `measured` ones) copy it."""
    first_of = {id(candidate.variant): candidate for candidate in measured}
    for candidate in candidates:
        first = first_of.setdefault(id(candidate.variant), candidate)
        if first is not candidate:
            copy_measurements(candidate, first)
            continue
        try:
            measure_candidate(candidate, call, reference)
        except Exception as error:  # a variant that breaks on a model is a finding, not the end of the run
            log.exception("  %s %s failed", candidate.row.mode, label(candidate.row))
            candidate.row.error = error_text(error)


def measured_ones(candidates: Sequence[Candidate]) -> list[Candidate]:
    return [candidate for candidate in candidates if candidate.row.error is None]


def time_candidates(candidates: Sequence[Candidate], call: ExampleCall, settings: Settings) -> None:
    """Interleaved training steps of every distinct variant; ratios against the mode's baseline."""
    runners: dict[int, Contender] = {}
    for candidate in candidates:
        if id(candidate.variant) not in runners:
            runners[id(candidate.variant)] = contender(
                label(candidate.row),
                candidate.variant.module,
                call.args,
                kwargs=call.kwargs,
                copy_module=candidate.row.mode is Mode.EAGER,
            )
    rounds = interleaved_step_ms(
        list(runners.values()),
        rounds=settings.rounds,
        warmup_steps=WARMUP_STEPS,
        timing_s=settings.timing_s,
        max_rounds=MAX_TIMING_ROUNDS,
    )
    log.info("  timed %d %s variants, %d rounds", len(runners), candidates[0].row.mode, rounds)
    baseline = runners[id(candidates[0].variant)]
    for candidate in candidates:
        runner = runners[id(candidate.variant)]
        candidate.row.step_ms = statistics.median(runner.step_ms)
        candidate.row.time_ratio_vs_none = paired_ratio(runner, baseline)
        candidate.row.round_ratios_vs_none = [
            step_ms / baseline_ms
            for step_ms, baseline_ms in zip(runner.step_ms, baseline.step_ms, strict=True)
        ]


def peer_candidate(name: str, built: tuple[Variant | None, str], mode: Mode) -> Candidate | Row:
    """A peer to measure, or its row saying why it does not apply to this model."""
    variant, description = built
    if variant is None:
        return Row(method=name, mode=mode, family=Family.PEER, not_applicable=description)
    return Candidate(Row(method=name, mode=mode, family=Family.PEER, description=description), variant)


def eager_rows(
    call: ExampleCall, reference: StepRecord, predicted: PredictedRange, settings: Settings
) -> list[Row]:
    """No checkpointing, the two hand-written peers, and our plans at the peers' measured peaks."""
    log.info(" eager rows")
    none = Candidate(
        Row(method=NO_CHECKPOINTING, mode=Mode.EAGER, family=Family.BASELINE), variant_of(call.model)
    )
    built = [
        peer_candidate(
            SQRT_SEGMENTS, sqrt_segments_peer(call.model, call.args, kwargs=call.kwargs), Mode.EAGER
        ),
        peer_candidate(EVERY_BLOCK, every_block_peer(call.model), Mode.EAGER),
    ]
    peers = [peer for peer in built if isinstance(peer, Candidate)]
    measure_candidate(none, call, reference)
    measure_all(peers, call, reference)
    ours, failed = our_candidates(OurPlans(call, none, predicted), measured_ones(peers))
    measure_all(ours, call, reference, measured=[none, *peers])
    time_candidates(measured_ones([none, *peers, *ours]), call, settings)
    not_applicable = [peer for peer in built if isinstance(peer, Row)]
    return [candidate.row for candidate in (none, *peers, *ours)] + not_applicable + failed


def fraction_candidate(call: ExampleCall, fraction: float) -> Candidate:
    baseline = fraction == NO_CHECKPOINTING_FRACTION
    row = Row(
        method=NO_CHECKPOINTING if baseline else f"compile budget {fraction:g}",
        mode=Mode.COMPILED,
        family=Family.BASELINE if baseline else Family.PEER,
        description=f"torch.compile, activation_memory_budget={fraction:g}",
        budget_fraction=fraction,
    )
    return Candidate(row, compiled(copied_variant(variant_of(call.model)), fraction))


def respects_fraction(row: Row, baseline: Row) -> bool | None:
    """Whether a compiled fraction kept at most its share of no-checkpointing's bytes after forward."""
    if row.budget_fraction is None or row.kept_after_forward_bytes is None:
        return None
    if baseline.kept_after_forward_bytes is None:
        return None
    allowed_bytes = (row.budget_fraction + KEPT_SLACK) * baseline.kept_after_forward_bytes
    return row.kept_after_forward_bytes <= allowed_bytes


def compiled_rows(call: ExampleCall, reference: StepRecord, settings: Settings) -> list[Row]:
    """torch.compile at each activation_memory_budget, and our plans of the compiled step at the
    fractions' peaks."""
    log.info(" compiled rows")
    none, *peers = [fraction_candidate(call, fraction) for fraction in settings.fractions]
    compiled_reference = measure_candidate(none, call, reference)
    measure_all(peers, call, compiled_reference)
    for peer in peers:
        peer.row.within_budget = respects_fraction(peer.row, none.row)
    ours, failed = our_candidates(CompiledPlans(call), measured_ones(peers))
    measure_all(ours, call, compiled_reference, measured=[none, *peers])
    time_candidates(measured_ones([none, *peers, *ours]), call, settings)
    return [candidate.row for candidate in (none, *peers, *ours)] + failed


def tracker_check(call: ExampleCall, compiled_none: Row | None) -> TrackerCheck:
    """The tracker against the allocator on the eager step, and what the tracker makes of a compiled one.

    Runs last: a compiled frame called under the tracker's dispatch mode is skipped by dynamo from then
    on (NOTE [measuring compiled steps]), so no compiled row may be measured or timed after this.
    """
    eager = planner.measure(copy.deepcopy(call.model), call.args, example_kwargs=call.kwargs).peak_bytes
    eager_allocator = allocator_step_memory(copy.deepcopy(call.model), call).peak_bytes
    module = compiled(copied_variant(variant_of(call.model)), NO_CHECKPOINTING_FRACTION).module
    under_tracker = planner.measure(module, call.args, example_kwargs=call.kwargs).peak_bytes
    afterwards = allocator_step_memory(module, call)
    return TrackerCheck(
        eager_tracker_peak_bytes=eager,
        eager_allocator_peak_bytes=eager_allocator,
        compiled_allocator_peak_bytes=compiled_none.peak_bytes if compiled_none else None,
        compiled_tracker_peak_bytes=under_tracker,
        ran_compiled_after_tracker=bool(afterwards.ran_compiled),
    )


def benchmark_model(name: str, settings: Settings) -> ModelResult:
    started_s = time.perf_counter()
    call = build_example(name, settings.device)
    result = ModelResult(name=name, device=settings.device)
    reference = one_step(variant_of(call.model), call.args, kwargs=call.kwargs)
    eager: list[Row] = []
    if not settings.compiled_only:
        reference_plan = optimize_at(call, REFERENCE_BUDGET_BYTES, "dp")
        predicted = PredictedRange(reference_plan)
        result.capture = reference_plan.capture
        result.predicted_min_peak_bytes = predicted.min_peak_bytes
        result.predicted_baseline_peak_bytes = predicted.baseline_peak_bytes
        eager = eager_rows(call, reference, predicted, settings)
    result.rows = eager + compiled_rows(call, reference, settings)
    if settings.device == "cpu":
        compiled_none = next(row for row in result.rows if row.mode is Mode.COMPILED)
        result.tracker_check = tracker_check(call, compiled_none)
    result.seconds = time.perf_counter() - started_s
    return result


def worker_threads(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // jobs)


def run_in_subprocess(name: str, settings: Settings, directory: Path) -> ModelResult:
    """One model in a fresh interpreter, its compiled code and memory die with it; stderr passes through."""
    out = directory / f"{name}.json"
    command = [
        sys.executable,
        "-m",
        "bench.compare",
        "--worker",
        name,
        "--worker-out",
        str(out),
        "--device",
        settings.device,
    ]
    command += ["--threads", str(worker_threads(settings.jobs)), *(["--quick"] if settings.quick else [])]
    command += ["--compiled-only"] if settings.compiled_only else []
    try:
        subprocess.run(command, check=True, timeout=MODEL_TIMEOUT_S, cwd=REPOSITORY)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        log.error("%s failed: %s", name, error)
        return ModelResult(name=name, device=settings.device, error=f"{type(error).__name__}: {error}")
    return result_from_dict(json.loads(out.read_text()))


def longest_first(names: Sequence[str], previous: Path) -> list[str]:
    """`names` by the seconds a previous run at `previous` took, longest (and unknown) first, so that
    parallel jobs finish together."""
    try:
        models = json.loads(previous.read_text())["models"]
        seconds = {name: float(model["seconds"] or 0.0) for name, model in models.items()}
    except (OSError, ValueError, KeyError, TypeError):
        seconds = {}
    return sorted(names, key=lambda name: -seconds.get(name, math.inf))


def run_all(names: Sequence[str], settings: Settings, *, previous: Path) -> list[ModelResult]:
    """Every model in its own process, `settings.jobs` at a time; results in the order of `names`."""
    started_s = time.perf_counter()

    def run(name: str) -> ModelResult:
        log.info("%s: started (%.0f s into the run)", name, time.perf_counter() - started_s)
        result = run_in_subprocess(name, settings, Path(directory))
        log.info("%s: done (%.0f s into the run)", name, time.perf_counter() - started_s)
        return result

    with tempfile.TemporaryDirectory(prefix="compare-") as directory:
        with concurrent.futures.ThreadPoolExecutor(max_workers=settings.jobs) as pool:
            order = longest_first(names, previous)
            by_name = dict(zip(order, pool.map(run, order), strict=True))
    return [by_name[name] for name in names]


def settings_for(arguments: argparse.Namespace) -> Settings:
    return Settings(
        device=arguments.device,
        fractions=QUICK_FRACTIONS if arguments.quick else FRACTIONS,
        rounds=QUICK_TIMING_ROUNDS if arguments.quick else TIMING_ROUNDS,
        timing_s=0.0 if arguments.quick else TIMING_S,
        quick=arguments.quick,
        jobs=arguments.jobs,
        compiled_only=arguments.compiled_only,
    )


def default_out(device: str, quick: bool) -> Path:
    suffix = ("" if device == "cpu" else f"_{device.replace(':', '')}") + ("_quick" if quick else "")
    return RESULTS_DIRECTORY / f"compare{suffix}.json"


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument(
        "--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}; fewer rounds and fractions"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda: a GPU run gets files of its own"
    )
    parser.add_argument(
        "--out", type=Path, help="JSON path (default bench/results/compare[_DEVICE][_quick].json)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"models at once, each with cpu_count/jobs torch threads (default {DEFAULT_JOBS})",
    )
    parser.add_argument("--render", type=Path, help="rewrite the .md and .png of a JSON this script wrote")
    parser.add_argument(
        "--compiled-only", action="store_true", help="the compiled rows alone (no eager peers or plans)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    default_models = QUICK_MODELS if arguments.quick else MODELS
    names = arguments.models.split(",") if arguments.models else list(default_models)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    arguments.models = names
    arguments.out = arguments.out or default_out(arguments.device, arguments.quick)
    return arguments


def worker_main(arguments: argparse.Namespace) -> int:
    """Benchmark one model (in the subprocess the parent started) and write its result as JSON."""
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    with compiler_settings():
        result = benchmark_model(arguments.worker, settings_for(arguments))
    arguments.worker_out.write_text(json.dumps(asdict(result), allow_nan=False))
    return 0


def write_results(results: Sequence[ModelResult], out: Path, context: dict[str, Any]) -> None:
    document = {**context, "models": {result.name: asdict(result) for result in results}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1, allow_nan=False, default=str) + "\n")
    write_tables(results, out, context)


def write_tables(results: Sequence[ModelResult], out: Path, context: dict[str, Any]) -> None:
    """The markdown (also to stdout) and the plot beside the JSON at `out`."""
    table = markdown(results, context)
    out.with_suffix(".md").write_text(table)
    refresh_quotes(out.with_suffix(".md"))
    run = "quick" if context["quick"] else "full"
    plot(
        results, out.with_suffix(".png"), title=f"{context['device']}: measured peak vs step time ({run} run)"
    )
    sys.stdout.write(table)


def render(path: Path) -> int:
    """Rewrite the tables and the plot of a JSON this script wrote, without measuring anything."""
    document = json.loads(path.read_text())
    results = [result_from_dict(model) for model in document["models"].values()]
    write_tables(results, path, {key: value for key, value in document.items() if key != "models"})
    return 0


def main(argv: Sequence[str]) -> int:
    arguments = parse_arguments(argv)
    source = arguments.worker or "%(name)s"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {source}: %(message)s")
    logging.getLogger("planner").setLevel(logging.WARNING)
    if arguments.worker:
        return worker_main(arguments)
    if arguments.render:
        return render(arguments.render)
    settings = settings_for(arguments)
    started_s = time.perf_counter()
    context: dict[str, Any] = {
        "device": settings.device,
        "machine": machine(),  # before the models load the machine, so the load average is the others'
        "planner_revision": planner_revision(),
        "command": [Path(sys.executable).name, *sys.argv],
        "quick": settings.quick,
        "rounds": settings.rounds,
        "timing_s": settings.timing_s,
        "fractions": settings.fractions,
        "jobs": settings.jobs,
        "compiled_only": settings.compiled_only,
        "torch_threads_per_model": worker_threads(settings.jobs),
    }
    results = run_all(arguments.models, settings, previous=arguments.out)
    context["total_s"] = time.perf_counter() - started_s
    write_results(results, arguments.out, context)
    log.info("wrote %s (.md, .png) in %.1f s", arguments.out, context["total_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
