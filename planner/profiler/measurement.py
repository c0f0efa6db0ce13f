"""Measures what a training step really costs: peak memory and step time.

On a GPU the peak is `torch.cuda.max_memory_allocated`, less what other tensors hold. On the CPU there is
no allocator statistic, and the step counts the bytes of live tensor storages instead
(`LiveStorageTracker` in counting.py), both in blocks and in exact bytes, and `measure_step` reports
both.

NOTE [compiled steps]: the tracker cannot count a `torch.compile`d step. Dynamo runs no compiled code
while a TorchDispatchMode is active (it runs the frame eagerly, and keeps skipping it afterwards), and
inductor's generated code allocates its buffers with `empty_strided_cpu`, which no dispatch mode sees.
For a compiled model on the CPU `measure_step` therefore counts the CPU allocator's own events
(`torch.profiler` with `profile_memory=True`: every allocation and free, inductor's included) on top of
the storages that exist when it starts (`AllocatorPhases` in counting.py).

NOTE [other tensors on the device]: the CUDA allocator's statistics are the whole device's, and a user
measuring a copy of `plan.module` still holds the model it came from, its example batch and whatever else
the process made (the first `make gpu-check` on an H100 measured every plan above its budget that way, by
up to 500 MB on a 270 MB step). The tracker on the CPU counts only the step's model, inputs and optimizer
state and the storages made during the step, so on a GPU `measure_step` counts the same: it collects
garbage, takes the bytes allocated on the device less the step's resident storages (parameters, their
gradients, buffers, inputs, optimizer state), and leaves them out of the peaks. They stay in the reserved
peak, as the allocator cannot say which of its segments they pin.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from planner.ir import MemoryCounting, OptimizerName, TrainingStep
from planner.profiler.counting import (
    AllocatorPhases,
    LiveStorageTracker,
    storage_bytes,
    tensors_in,
)
from planner.profiler.rank_memory import ResizingStorageTracker, ddp_bucket_sizes, is_data_parallel
from planner.simulation.allocator import AllocatorEvent

__all__ = [
    "MeasuredStep",
    "MeasuredTimeline",
    "OptimizerSpec",
    "default_loss",
    "end_autocast_forward",
    "is_compiled",
    "make_optimizer",
    "measure_step",
    "measure_timeline",
    "record_allocations",
    "start_autocast_forward",
]

OptimizerSpec = str | torch.optim.Optimizer | None
""""adam", "adamw", "sgd", "sgd-momentum", "adagrad", "adafactor", None, or an optimizer instance over
the model's parameters. A name means torch.optim's class with its defaults, so its implementation
(foreach on CUDA, single-tensor on the CPU) is PyTorch's default for the device."""


OPTIMIZER_NAMES = tuple(name.value for name in OptimizerName)


def start_autocast_forward() -> None:
    """Start a forward with no bf16 weight copies cached, as each step of a training loop does.

    Under the caller's autocast block, the planner's own forwards before the profiled one (capture,
    probes of calls it cannot trace) leave their weight copies in autocast's cache, and the profiled
    forward would reuse them with their old grad_fn: the backward then casts those weights' gradients
    to float32 apart from their nodes, and the profile charged them to no node (hooked_mlp in bf16:
    predicted 33 KiB low, plans over budget). See NOTE [autocast] in `end_autocast_forward`.
    """
    torch.clear_autocast_cache()


def end_autocast_forward() -> None:
    """Free autocast's cached low-precision weight copies, as leaving a `torch.autocast` block does.

    NOTE [autocast]: PyTorch's mixed-precision recipe runs forward and loss under `torch.autocast`
    and backward outside it; leaving the block frees the bf16 copies of the weights that autograd
    did not save. `optimize` and `measure` run a whole step inside the caller's autocast block, so
    they free the copies at the same point, after the loss. (Left in the cache, the copies would
    also be stale in the next step, after the optimizer changed the weights.)
    """
    torch.clear_autocast_cache()


def default_loss(output: Any) -> torch.Tensor:
    """The sum of every floating-point tensor in the model's output: a scalar that reaches all outputs."""
    floating = [t for t in tensors_in(output) if t.is_floating_point()]
    if not floating:
        raise TypeError(
            f"the model's output has no floating-point tensor to build a default loss from "
            f"(got {type(output).__name__}); pass loss_fn=lambda output: <scalar tensor>"
        )
    total = floating[0].sum()
    for tensor in floating[1:]:
        total = total + tensor.sum()
    return total


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model` is a `torch.compile`d module (NOTE [compiled steps])."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def make_optimizer(
    spec: OptimizerSpec, parameters: Sequence[torch.nn.Parameter]
) -> torch.optim.Optimizer | None:
    """Build the optimizer named by `spec` over `parameters` (an instance is returned unchanged)."""
    if spec is None or isinstance(spec, torch.optim.Optimizer):
        return spec
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        OptimizerName.ADAM: lambda: torch.optim.Adam(parameters, lr=1e-3),
        OptimizerName.ADAMW: lambda: torch.optim.AdamW(parameters, lr=1e-3),
        OptimizerName.SGD: lambda: torch.optim.SGD(parameters, lr=1e-3),
        OptimizerName.SGD_MOMENTUM: lambda: torch.optim.SGD(parameters, lr=1e-3, momentum=0.9),
        OptimizerName.ADAGRAD: lambda: torch.optim.Adagrad(parameters, lr=1e-2),
        OptimizerName.ADAFACTOR: lambda: torch.optim.Adafactor(parameters, lr=1e-2),
    }
    if spec not in factories:
        raise ValueError(
            f"optimizer={spec!r} is not known; use one of {OPTIMIZER_NAMES}, None, or a torch.optim.Optimizer"
        )
    return factories[spec]()


@dataclass(frozen=True)
class MeasuredStep:
    """Measured peak and time of real training steps (the first two steps' peak; median step time).

    `peak_bytes` and `phase_peak_bytes` count each storage in 512-byte blocks, as CUDA's caching
    allocator counts them (on a GPU: `torch.cuda.max_memory_allocated`); `exact_peak_bytes` counts
    tensor bytes (on a GPU: the allocator's requested bytes). Compare a plan's prediction with
    `peak_in(plan.graph.memory_counting)`. `reserved_peak_bytes` is what the allocator reserved from
    the device (`torch.cuda.max_memory_reserved`): None on the CPU, which has no caching allocator.
    On a GPU `others_bytes` is what other tensors held on the device when the step began, left out of
    `peak_bytes` and `exact_peak_bytes` but not of `reserved_peak_bytes` (NOTE [other tensors on the
    device]); on the CPU the live-storage tracker never counts them, and it is 0.
    """

    peak_bytes: int
    phase_peak_bytes: dict[str, int]
    step_ms: float | None
    device: str
    exact_peak_bytes: int = 0
    reserved_peak_bytes: int | None = None
    others_bytes: int = 0

    def peak_in(self, counting: MemoryCounting) -> int:
        """The peak as `counting` counts it."""
        return self.peak_bytes if MemoryCounting(counting) is MemoryCounting.BLOCKS else self.exact_peak_bytes


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def _train_step(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    on_phase: Callable[[str], None],
    step: TrainingStep,
    scaler: torch.amp.GradScaler | None,
) -> None:
    """One optimizer step as `step` describes it, each micro-batch on `inputs`; `on_phase` is called
    at the end of each phase ("forward", "backward", ...) with its name."""
    zero_grad = optimizer.zero_grad if optimizer is not None else model.zero_grad
    if not step.zero_grad_before_backward:
        zero_grad(set_to_none=step.zero_grad_set_to_none)
    for micro_batch in range(step.accumulation_steps):
        for tensor in tensors_in((inputs, kwargs)):
            tensor.grad = None  # each micro-batch gets a fresh batch; its gradient does not carry over
        on_phase("start")
        start_autocast_forward()
        loss = loss_fn(model(*inputs, **kwargs))
        end_autocast_forward()
        on_phase("forward")
        if step.zero_grad_before_backward and micro_batch == 0:  # NOTE [loop orders] in ir.py
            zero_grad(set_to_none=step.zero_grad_set_to_none)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss
        on_phase("backward")
    if scaler is not None and optimizer is not None:
        scaler.unscale_(optimizer)
        on_phase("unscale")
    if step.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], step.max_grad_norm)
        on_phase("clip gradients")
    if optimizer is not None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    on_phase("optimizer step")


def _grad_scaler(step: TrainingStep, device: torch.device) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(device.type) if step.grad_scaler else None


@dataclass
class _Peaks:
    """Peaks of a measured step: per phase in blocks, and overall in exact and reserved bytes."""

    phase_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    exact_bytes: int = 0
    reserved_bytes: int | None = None
    others_bytes: int = 0


def _cuda_peaks(
    run: Callable[[Callable[[str], None]], None], device: torch.device, resident: list[torch.Tensor]
) -> _Peaks:
    """Two steps on a GPU: the allocator's own statistics (allocated bytes are 512-byte blocks), less
    what other tensors held on the device when the step began (NOTE [other tensors on the device])."""
    gc.collect()  # garbage of earlier steps (an optimizer in a reference cycle) is not this step's
    torch.cuda.synchronize(device)
    on_device = [tensor for tensor in resident if tensor.device == device]
    stats = torch.cuda.memory_stats(device)
    others_bytes = max(
        0, stats["allocated_bytes.all.current"] - storage_bytes(on_device, MemoryCounting.BLOCKS)
    )
    others_exact_bytes = max(
        0, stats["requested_bytes.all.current"] - storage_bytes(on_device, MemoryCounting.EXACT)
    )
    peaks = _Peaks(reserved_bytes=0, others_bytes=others_bytes)
    torch.cuda.reset_peak_memory_stats(device)

    def on_phase(phase: str) -> None:
        torch.cuda.synchronize(device)
        stats = torch.cuda.memory_stats(device)
        allocated_bytes = stats["allocated_bytes.all.peak"] - others_bytes
        peaks.phase_bytes[phase] = max(peaks.phase_bytes.get(phase, 0), allocated_bytes)
        peaks.exact_bytes = max(peaks.exact_bytes, stats["requested_bytes.all.peak"] - others_exact_bytes)
        peaks.reserved_bytes = max(peaks.reserved_bytes or 0, stats["reserved_bytes.all.peak"])
        torch.cuda.reset_peak_memory_stats(device)

    for _ in range(2):
        run(on_phase)
    return peaks


def _allocator_peaks(run: Callable[[Callable[[str], None]], None], resident: list[torch.Tensor]) -> _Peaks:
    """Two steps of a compiled model on the CPU, from the allocator's events (NOTE [compiled steps])."""
    with AllocatorPhases(resident, MemoryCounting.BLOCKS) as allocator:
        for _ in range(2):
            run(allocator.on_phase)
    return _Peaks(phase_bytes=dict(allocator.peaks), exact_bytes=max(allocator.exact_peaks.values()))


def _tracked_peaks(
    run: Callable[[Callable[[str], None]], None], resident: list[torch.Tensor], model: torch.nn.Module
) -> _Peaks:
    """Two steps on the CPU (or any device), counted by the live-storage tracker; for a model under
    DDP or FSDP2, by the tracker that also sees what they allocate outside operators (rank_memory.py)."""
    peaks = _Peaks()
    tracker: LiveStorageTracker
    if is_data_parallel(model):
        tracker = ResizingStorageTracker(MemoryCounting.BLOCKS)
        for bucket_bytes in ddp_bucket_sizes(model):
            tracker.hold(bucket_bytes)
    else:
        tracker = LiveStorageTracker(MemoryCounting.BLOCKS)
    tracker.track(resident)

    def on_phase(phase: str) -> None:
        if isinstance(tracker, ResizingStorageTracker):
            tracker.refresh()
        peaks.phase_bytes[phase] = max(peaks.phase_bytes.get(phase, 0), tracker.peak_bytes)
        peaks.exact_bytes = max(peaks.exact_bytes, tracker.exact_peak_bytes)
        tracker.reset_peak()

    with tracker:
        for _ in range(2):
            run(on_phase)
    return peaks


def measure_step(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    optimizer: OptimizerSpec = "adam",
    step: TrainingStep | None = None,
    timed_steps: int = 0,
) -> MeasuredStep:
    """Run two real training steps as `step` describes them (accumulation, unscaling, clipping; one
    micro-batch by default) and report their peak memory, in 512-byte blocks and in exact bytes
    (`MeasuredStep`); optionally time more steps.

    This trains `model`: its parameters, optimizer state and BatchNorm statistics change. Measure a
    copy (`copy.deepcopy`) when the original must stay as it is.
    """
    step = step or TrainingStep()
    parameters = [p for p in model.parameters() if p.requires_grad]
    built = make_optimizer(optimizer, parameters)
    kwargs = dict(example_kwargs or {})
    first = next(iter(tensors_in((tuple(model.parameters()), inputs, kwargs))), None)
    device = first.device if first is not None else torch.device("cpu")
    scaler = _grad_scaler(step, device)
    run = functools.partial(_train_step, model, inputs, kwargs, loss_fn, built, step=step, scaler=scaler)
    resident = [*model.parameters(), *model.buffers(), *tensors_in((inputs, kwargs))]
    resident += _optimizer_state_tensors(built)
    if device.type == "cuda":
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        peaks = _cuda_peaks(run, device, [*resident, *grads])
    elif is_compiled(model):
        model.zero_grad(set_to_none=True)  # a gradient freed inside the window would not be seen freed
        peaks = _allocator_peaks(run, resident)
    else:
        peaks = _tracked_peaks(run, resident, model)
    peaks.phase_bytes.pop("start", None)
    step_ms = _median_step_ms(run, timed_steps) if timed_steps > 0 else None
    return MeasuredStep(
        peak_bytes=max(peaks.phase_bytes.values()),
        phase_peak_bytes=peaks.phase_bytes,
        step_ms=step_ms,
        device=str(device),
        exact_peak_bytes=peaks.exact_bytes,
        reserved_peak_bytes=peaks.reserved_bytes,
        others_bytes=peaks.others_bytes,
    )


def _median_step_ms(run: Callable[[Callable[[str], None]], None], steps: int) -> float:
    durations_ms = []
    for _ in range(steps):
        started = time.perf_counter()
        run(lambda _phase: None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        durations_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(durations_ms)


@dataclass(frozen=True)
class MeasuredTimeline:
    """Live tensor-storage bytes after each operator of one steady-state training step, by phase.

    `samples` are (phase, live bytes) pairs in execution order; phases are "forward" (model and loss),
    "backward" and "optimizer step". The step is the second of two, so the optimizer state exists.
    """

    samples: tuple[tuple[str, int], ...]
    peak_bytes: int
    device: str


class _TimelineTracker(LiveStorageTracker):
    """A LiveStorageTracker that also notes the live bytes after every operator."""

    def __init__(self) -> None:
        super().__init__()
        self.after_each_operator: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = super().__torch_dispatch__(func, types, args, kwargs)
        self.after_each_operator.append(self.live_bytes)
        return output


def measure_timeline(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    optimizer: OptimizerSpec = "adam",
) -> MeasuredTimeline:
    """The measured counterpart of a plan's simulated trace (for `Plan.plot_timeline(measured=...)`).

    Runs two real training steps under the live-storage tracker (on any device; see the module
    docstring) and keeps the second step's per-operator samples. A peak inside one operator (its
    temporaries) is not seen, so `peak_bytes` can be below `measure_step`'s. Trains `model`, like
    `measure_step`: pass a copy to keep the original.
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    built = make_optimizer(optimizer, parameters)
    kwargs = dict(example_kwargs or {})
    tracker = _TimelineTracker()
    tracker.track([*model.parameters(), *model.buffers(), *tensors_in((inputs, kwargs))])
    samples: list[tuple[str, int]] = []

    def on_phase(phase: str) -> None:
        if phase != "start":
            samples.extend((phase, live_bytes) for live_bytes in tracker.after_each_operator)
        tracker.after_each_operator.clear()

    run = functools.partial(
        _train_step, model, inputs, kwargs, loss_fn, built, step=TrainingStep(), scaler=None
    )
    with tracker:
        run(lambda _phase: None)
        tracker.after_each_operator.clear()
        run(on_phase)
    first = next(iter(tensors_in((tuple(model.parameters()), inputs, kwargs))), None)
    return MeasuredTimeline(
        samples=tuple(samples),
        peak_bytes=max((live_bytes for _, live_bytes in samples), default=tracker.live_bytes),
        device=str(first.device if first is not None else torch.device("cpu")),
    )


class _AllocationRecorder(LiveStorageTracker):
    """A LiveStorageTracker that also writes each storage's allocation and free as an allocator event,
    named by the operator that made it."""

    def __init__(self) -> None:
        super().__init__(MemoryCounting.EXACT)
        self.events: list[AllocatorEvent] = []
        self._operator = "resident"

    def _register(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        fresh = id(storage) not in self._tracked and storage.nbytes() > 0
        super()._register(tensor)
        if fresh:
            name = f"{self._operator}#{len(self.events)}"
            self.events.append(("malloc", name, storage.nbytes()))
            weakref.finalize(storage, self.events.append, ("free", name))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._operator = str(func.overloadpacket.__name__)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._operator = "resident"


def record_allocations(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    optimizer: OptimizerSpec = "adam",
    step: TrainingStep | None = None,
) -> list[AllocatorEvent]:
    """Every tensor storage two real training steps allocate and free, in order, as allocator events
    ("malloc", name, bytes) / ("free", name) named by the operator that made each (parameters, buffers
    and inputs first, as "resident"): a measured step for the caching allocator model
    (simulation/allocator.py). Trains `model`, like `measure_step`."""
    step = step or TrainingStep()
    parameters = [p for p in model.parameters() if p.requires_grad]
    built = make_optimizer(optimizer, parameters)
    kwargs = dict(example_kwargs or {})
    first = next(iter(tensors_in((tuple(model.parameters()), inputs, kwargs))), None)
    device = first.device if first is not None else torch.device("cpu")
    run = functools.partial(
        _train_step, model, inputs, kwargs, loss_fn, built, step=step, scaler=_grad_scaler(step, device)
    )
    recorder = _AllocationRecorder()
    recorder.track([*model.parameters(), *model.buffers(), *tensors_in((inputs, kwargs))])
    with recorder:
        for _ in range(2):
            run(lambda _phase: None)
    gc.collect()
    return list(recorder.events)
