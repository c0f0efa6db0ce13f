"""Measures what a training step really costs: peak memory and step time.

On a GPU the peak is `torch.cuda.max_memory_allocated`. On the CPU there is no allocator statistic, and
RSS counts the Python heap, freed-but-cached pages and libraries, so it is not a memory measurement.
Instead `LiveStorageTracker` counts the bytes of live tensor storages: a TorchDispatchMode sees every
tensor an operator creates (forward, backward and optimizer alike), registers its storage once, and a
weakref finalizer subtracts it when the storage is freed. Views share a storage and count once. This
is the quantity `torch.cuda.memory_allocated` reports on a GPU, less the allocator's rounding.

NOTE [compiled steps]: the tracker cannot count a `torch.compile`d step. Dynamo runs no compiled code
while a TorchDispatchMode is active (it runs the frame eagerly, and keeps skipping it afterwards), and
inductor's generated code allocates its buffers with `empty_strided_cpu`, which no dispatch mode
sees. For a compiled model on the CPU `measure_step` therefore counts the CPU allocator's own events
(`torch.profiler` with `profile_memory=True`: every allocation and free, inductor's included) on top of
the storages that exist when it starts (`AllocatorPhases`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.ir import OptimizerName, TrainingStep

__all__ = [
    "AllocatorPhases",
    "LiveStorageTracker",
    "MeasuredStep",
    "MeasuredTimeline",
    "OptimizerSpec",
    "default_loss",
    "end_autocast_forward",
    "is_compiled",
    "make_optimizer",
    "measure_step",
    "measure_timeline",
    "start_autocast_forward",
    "storage_bytes",
]

OptimizerSpec = str | torch.optim.Optimizer | None
""""adam", "adamw", "sgd", "sgd-momentum", "adagrad", "adafactor", None, or an optimizer instance over
the model's parameters. A name means torch.optim's class with its defaults, so its implementation
(foreach on CUDA, single-tensor on the CPU) is PyTorch's default for the device."""


OPTIMIZER_NAMES = tuple(name.value for name in OptimizerName)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists, dicts, pytree nodes (Hugging Face's
    `ModelOutput`) and dataclasses (which pytree does not open unless registered)."""
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += tensors_in([getattr(leaf, field.name) for field in dataclasses.fields(leaf)])
    return found


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


class LiveStorageTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes and their peak while active (CPU or any device).

    Storages created before the tracker is entered are invisible unless passed to `track`; register
    parameters, buffers, inputs and optimizer state that way.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tracked: set[int] = set()

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of tensors that already exist."""
        for tensor in tensors:
            self._register(tensor)

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak_bytes = self.live_bytes

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        return id(tensor.untyped_storage()) in self._tracked

    def _register(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        size_bytes = storage.nbytes()
        if key in self._tracked or size_bytes == 0:
            return
        self._tracked.add(key)
        self.live_bytes += size_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key, size_bytes)

    def _release(self, key: int, size_bytes: int) -> None:
        self._tracked.discard(key)
        self.live_bytes -= size_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        for tensor in tensors_in(output):
            self._register(tensor)
        return output


AFTER_LAST_PHASE = "after the last phase"
"""`AllocatorPhases.peaks` key of what ran after the last `on_phase` call."""
PHASE_MARK = "planner.phase:"
"""Name prefix of the profiler events `AllocatorPhases` marks the end of each phase with."""


class AllocatorPhases:
    """Peak live bytes per phase from the CPU allocator's events (NOTE [compiled steps]).

    Use as a context manager; call `on_phase(name)` at the end of each phase. When the context exits,
    `peaks` holds each phase's peak and `ends` the live bytes at its (last) end, both with
    `resident_bytes` added, and `event_names` the names of every profiler event seen.
    """

    def __init__(self, resident_bytes: int) -> None:
        self.resident_bytes = resident_bytes
        self.peaks: dict[str, int] = {}
        self.ends: dict[str, int] = {}
        self.event_names: set[str] = set()
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )

    def on_phase(self, phase: str) -> None:
        with torch.profiler.record_function(PHASE_MARK + phase):
            pass

    def __enter__(self) -> AllocatorPhases:
        # The CPU allocator remembers the size of a block allocated under an earlier memory profile
        # and reports its free in this one: garbage from an earlier measurement (an optimizer's
        # state in a reference cycle) collected inside this window lowers the live bytes, most
        # likely why a compiled peer measured 4.2 MB under its peak in one CI run. Collect it first.
        gc.collect()
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._profiler.__exit__(*exc_info)
        assert self._profiler.profiler is not None and self._profiler.profiler.kineto_results is not None
        events = sorted(self._profiler.profiler.kineto_results.events(), key=lambda event: event.start_ns())
        live_bytes = phase_peak_bytes = 0
        unmarked = False
        for event in events:
            self.event_names.add(event.name())
            if event.name() == "[memory]":
                live_bytes += event.nbytes()  # type: ignore[attr-defined]  # in the binding, not its stub
                phase_peak_bytes = max(phase_peak_bytes, live_bytes)
                unmarked = True
            elif event.name().startswith(PHASE_MARK):
                phase = event.name().removeprefix(PHASE_MARK)
                peak_bytes = self.resident_bytes + phase_peak_bytes
                self.peaks[phase] = max(self.peaks.get(phase, 0), peak_bytes)
                self.ends[phase] = self.resident_bytes + live_bytes
                phase_peak_bytes, unmarked = live_bytes, False
        if unmarked or not self.peaks:
            self.peaks[AFTER_LAST_PHASE] = self.resident_bytes + phase_peak_bytes


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model` is a `torch.compile`d module (NOTE [compiled steps])."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (tied weights and views count once)."""
    sizes = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(sizes.values())


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
    """Measured peak and time of real training steps (the first two steps' peak; median step time)."""

    peak_bytes: int
    phase_peak_bytes: dict[str, int]
    step_ms: float | None
    device: str


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
    zero_grad(set_to_none=step.zero_grad_set_to_none)
    for _ in range(step.accumulation_steps):
        for tensor in tensors_in((inputs, kwargs)):
            tensor.grad = None  # each micro-batch gets a fresh batch; its gradient does not carry over
        on_phase("start")
        start_autocast_forward()
        loss = loss_fn(model(*inputs, **kwargs))
        end_autocast_forward()
        on_phase("forward")
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


@contextmanager
def _cuda_phases(device: torch.device) -> Iterator[Callable[[str], None]]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    peaks: dict[str, int] = {}

    def on_phase(phase: str) -> None:
        torch.cuda.synchronize(device)
        peaks[phase] = max(peaks.get(phase, 0), torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)

    on_phase.peaks = peaks  # type: ignore[attr-defined]
    yield on_phase


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
    micro-batch by default) and report their peak memory; optionally time more steps.

    This trains `model`: its parameters, optimizer state and BatchNorm statistics change. Measure a
    copy (`copy.deepcopy`) when the original must stay as it is.
    """
    step = step or TrainingStep()
    parameters = [p for p in model.parameters() if p.requires_grad]
    built = make_optimizer(optimizer, parameters)
    kwargs = dict(example_kwargs or {})
    first = next(iter(tensors_in((tuple(model.parameters()), inputs, kwargs))), None)
    device = first.device if first is not None else torch.device("cpu")
    phase_peaks: dict[str, int] = {}
    scaler = _grad_scaler(step, device)
    run = functools.partial(_train_step, model, inputs, kwargs, loss_fn, built, step=step, scaler=scaler)
    if device.type == "cuda":
        with _cuda_phases(device) as on_phase:
            for _ in range(2):
                run(on_phase)
            phase_peaks = dict(on_phase.peaks)  # type: ignore[attr-defined]
    elif is_compiled(model):
        existing = [*model.parameters(), *model.buffers(), *tensors_in((inputs, kwargs))]
        existing += _optimizer_state_tensors(built)
        model.zero_grad(set_to_none=True)  # a gradient freed inside the window would not be seen freed
        with AllocatorPhases(storage_bytes(existing)) as allocator:
            for _ in range(2):
                run(allocator.on_phase)
        phase_peaks = dict(allocator.peaks)
    else:
        tracker = LiveStorageTracker()
        tracker.track(
            [
                *model.parameters(),
                *model.buffers(),
                *tensors_in((inputs, kwargs)),
                *_optimizer_state_tensors(built),
            ]
        )

        def on_phase(phase: str) -> None:
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), tracker.peak_bytes)
            tracker.reset_peak()

        with tracker:
            for _ in range(2):
                run(on_phase)
    phase_peaks.pop("start", None)
    step_ms = _median_step_ms(run, timed_steps) if timed_steps > 0 else None
    return MeasuredStep(
        peak_bytes=max(phase_peaks.values()),
        phase_peak_bytes=phase_peaks,
        step_ms=step_ms,
        device=str(device),
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
