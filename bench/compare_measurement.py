"""How bench/compare.py compiles and measures the variant behind each of its rows: the memory of two
training steps in the currency of the row's mode, and the gradients of one step against the reference.

Why it exists: a comparison is only as fair as its measurement, and the measurement is where compiled
steps need care (the notes below): the live-storage tracker cannot see compiled code, inductor draws its
own dropout masks, and dynamo caches and logging decide what gets compiled. compare.py decides which
rows a model gets and runs them; this is what one row's numbers mean, and bench/kernel_time.py,
bench/compile_time.py and tests/test_compare_bench.py build and measure variants the same way with it.

NOTE [measuring compiled steps]: on the CPU `planner.measure` counts live tensor storages with a
TorchDispatchMode. Dynamo does not run compiled code while a dispatch mode is active: it runs the
frames eagerly, and keeps skipping them afterwards, so the tracker would report the *eager* peak of a
compiled module (and spoil the module for timing). Compiled rows therefore count the CPU allocator's own
events (`torch.profiler` with `profile_memory=True`: every allocation and free, inductor's buffers
included) on top of the bytes of parameters, buffers and inputs; a row notes when its step did not run
compiled code. The tracker's view is taken once per model at the very end, as compare.py's
`tracker_check`, to show the difference. Eager rows use `planner.measure`, the currency our budgets are
planned in; on the eager no-checkpointing step both counts are recorded side by side. On a GPU every row
uses the caching allocator's statistics (`max_memory_allocated`), less the memory that other variants in
the process hold.

NOTE [compiled gradients]: inductor draws dropout masks with its own generator, not eager's, so on a
model with dropout a compiled step's loss differs from the eager step's. Compiled rows are therefore
compared with compiled no checkpointing (same seed, so the same masks in the forward); compiled no
checkpointing is compared with the eager model where their losses agree. Inductor reorders reductions,
so float32 gradients differ by rounding, and by up to a few percent of a tensor whose true gradient is
~0 (a bias before BatchNorm): compiled rows pass when the loss and the gradient of the whole model agree
to `COMPILED_GRADIENT_RTOL` of its norm (`planner.testing.steps.gradient_error`).
(`torch._inductor.config.fallback_random` would draw eager's masks, but then a random op that the
partitioner recomputes draws a new mask: not what users run.)

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
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import planner
from bench.compare_report import Family, Mode, Row, label
from bench.peers import GRADIENT_RTOL, mib
from planner.compiled.step import log_methods as planner_log_methods
from planner.profiler.counting import AllocatorPhases, storage_bytes, tensors_in
from planner.profiler.measurement import default_loss
from planner.testing.steps import (
    StepRecord,
    Variant,
    buffer_mismatch,
    gradient_error,
    gradient_mismatch,
    one_step,
    record_step,
)
from planner.testing.zoo_real import ExampleCall

log = logging.getLogger(__name__)

COMPILED_GRADIENT_RTOL = 1e-3
"""Inductor fuses and reorders reductions: a compiled step's loss and gradient norm match eager ones to
~1e-6 in float32 (to 1e-13 in float64, so the difference is rounding); another dropout mask changes the
gradient by tens of percent of its norm."""
COMPILED_BUFFER_RTOL = 1e-5
"""BatchNorm running statistics of a compiled step match eager ones to ~2e-6 of their scale, not bitwise."""
RECOMPILE_LIMIT = 64
"""Dynamo's cache entries per code object; every compiled variant of one model class needs its own."""
COMPILED_REGION_EVENT = "Torch-Compiled Region"
"""Profiler event name of a compiled frame: its absence means dynamo ran the step eagerly."""
BEFORE_FORWARD, FORWARD = "before forward", "forward"
"""Phases `allocator_step_memory` marks: the bytes kept after forward are the second's end less the
first's."""
DIFFERENT_MASKS = "not comparable: inductor draws other dropout masks than eager (NOTE [compiled gradients])"


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
