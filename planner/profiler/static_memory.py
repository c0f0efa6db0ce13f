"""Memory that no checkpoint schedule changes: parameters, buffers, inputs, gradients, and the
optimizer's state and step temporaries, with those of clipping and GradScaler's unscale.

Storages are counted once however many tensors share them (tied weights). The optimizer is not
modelled from its formulas: real steps run over zero-filled stand-ins of the parameters, under the
live-storage tracker, with the implementation PyTorch picks on the planned device (NOTE [optimizer
implementation]). State is probed once per parameter shape and group. A foreach or fused step holds
temporaries the size of a whole group, so it is probed on stand-ins of every trainable parameter in
the optimizer's own groups, scaled down uniformly beyond `OPTIMIZER_PROBE_ELEMENTS` (and on the meta
device) and scaled back up, since the temporaries are elementwise. A single-tensor step holds about
one parameter's worth, so it is probed exactly on full-size copies of its largest parameters, each
with the one before it.

NOTE [optimizer implementation]: `torch.optim` runs an optimizer single-tensor (a Python loop over
parameters), foreach (multi-tensor kernels over a group) or fused. With `foreach=None` and
`fused=None` it picks foreach when every parameter is on a device with foreach kernels (CUDA), else
single-tensor (`_default_to_fused_or_foreach`). A named optimizer ("adam") is built with those
defaults; an instance keeps its own flags. Either way the choice is resolved for the planned device
(`device_type`) before probing, so a plan made on the meta device for a GPU counts what a foreach
step allocates there.

NOTE [step counts on the host]: Adam, AdamW, RMSprop, Adagrad and their kin keep each parameter's step
count as a 0-dim tensor on the CPU unless the group is fused or capturable (`_init_group`: `torch.tensor(
0.0)` against `torch.zeros((), device=p.device)`), so on a GPU it takes none of the card's memory, where
a CPU step counts it in a 512-byte block per parameter. State is counted where the probe finds it: on
the stand-in's device when the probe runs on the planned device type; when it runs on the CPU for a GPU
(a plan made on meta or CPU parameters), a scalar counts only in a fused or capturable group. Counting
the host's step counts put every Hugging Face prediction on an H200 a block per parameter tensor above
`max_memory_allocated` (hf_gpt2: 28 tensors, 14,336 B; hf_bert: 42, 21,504 B) in every phase, and
priced the switch's own plan out of a budget at the switch's measured peak.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from planner.ir import NO_OPTIMIZER, StaticBytes, TrainingStep
from planner.profiler.counting import (
    LiveStorageTracker,
    counted_bytes,
    local_tensors,
    storage_of,
    tensors_in,
)
from planner.profiler.measurement import OptimizerSpec, make_optimizer

__all__ = [
    "constant_bytes",
    "extra_static_tensors",
    "optimizer_implementation",
    "optimizer_name",
    "static_bytes",
]

META_PROBE_ELEMENTS = 2**16
"""Elements of the CPU stand-in for a meta parameter when probing the optimizer's state."""
OPTIMIZER_PROBES = 3
"""Largest parameters whose single-tensor step is probed for temporaries."""
OPTIMIZER_PROBE_ELEMENTS = 2**22
"""Elements of all stand-ins together when probing the step's temporaries (16 MiB in fp32): enough to
make scalar temporaries (a step count per parameter) negligible, small enough to probe a 7B model."""


def _unique_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        storage = storage_of(tensor)
        if id(storage) not in seen:
            seen.add(id(storage))
            total += counted_bytes(storage.nbytes())
    return total


def _gradient_bytes_of(parameters: list[torch.nn.Parameter]) -> int:
    """Bytes of the parameters' `.grad` buffers (one per parameter object, in the parameter's dtype)."""
    unique = {id(p): p for p in parameters}
    return sum(counted_bytes(_local(p).numel() * p.element_size()) for p in unique.values())


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """The part of `parameter` this rank holds: a DTensor's local shard (NOTE [wrapper subclasses] in
    counting.py), a plain tensor itself. Its state, gradient and step temporaries are the shard's size."""
    (local,) = local_tensors(parameter)
    return local


def optimizer_implementation(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], device_type: str
) -> str:
    """How `optimizer` runs `group` on `device_type`: "fused", "foreach" or "single-tensor" (NOTE
    [optimizer implementation])."""
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        accepted = inspect.signature(type(optimizer).__init__).parameters
        foreach = (
            "foreach" in accepted
            and not group.get("differentiable", False)
            and device_type in _get_foreach_kernels_supported_devices()
        )
    return "foreach" if foreach else "single-tensor"


def _implementation_flags(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], device_type: str
) -> dict[str, Any]:
    """The group's foreach/fused settings, resolved for `device_type`, for a copy built elsewhere."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    implementation = optimizer_implementation(optimizer, group, device_type)
    flags: dict[str, Any] = {}
    if "foreach" in accepted:
        flags["foreach"] = implementation == "foreach"
    if "fused" in accepted:
        flags["fused"] = implementation == "fused" or None
    return flags


def _stand_in(parameter: torch.nn.Parameter, scale: float) -> torch.nn.Parameter:
    """A zero-filled copy of `parameter` with at least `scale` of its elements, shrinking the leading
    dimensions first (so a matrix stays a matrix for factored optimizers), on the CPU for meta.

    Each dimension is rounded up, so elements(stand-in) >= scale * elements(parameter): temporaries
    measured on stand-ins and divided by `scale` bound those of the parameters from above.
    """
    shape = list(_local(parameter).shape)
    remaining = scale
    for axis, size in enumerate(shape):
        if remaining >= 1.0:
            break
        shrunk = max(1, math.ceil(size * remaining))
        remaining *= size / shrunk
        shape[axis] = shrunk
    device = torch.device("cpu") if parameter.is_meta else parameter.device
    stand_in = torch.nn.Parameter(torch.zeros(shape, dtype=parameter.dtype, device=device))
    stand_in.grad = torch.zeros_like(stand_in)
    return stand_in


def _scale_for(parameters: list[torch.nn.Parameter], limit_elements: float) -> float:
    """The uniform scale that brings `parameters` down to about `limit_elements` (1: full size)."""
    total_elements = sum(_local(p).numel() for p in {id(p): p for p in parameters}.values())
    return min(1.0, limit_elements / max(1, total_elements))


def _template(spec: OptimizerSpec, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer instance `spec` is, or the one a name builds over `parameters` (never stepped)."""
    template = spec if isinstance(spec, torch.optim.Optimizer) else make_optimizer(spec, parameters)
    assert template is not None, "callers handle optimizer=None"
    return template


def _copy_optimizer(
    spec: OptimizerSpec,
    stand_ins: dict[int, torch.nn.Parameter],
    parameters: list[torch.nn.Parameter],
    device_type: str,
) -> torch.optim.Optimizer:
    """The optimizer `spec` over the stand-ins, in the same groups, running as on `device_type`.

    An instance built over other tensors than `parameters` (a copy of the model) is applied with its
    defaults to all of them, as it would be to this model's parameters.
    """
    template = _template(spec, parameters)
    accepted = inspect.signature(type(template).__init__).parameters
    groups = []
    for group in template.param_groups:
        params = [stand_ins[id(p)] for p in group["params"] if id(p) in stand_ins]
        if params:
            settings = {k: v for k, v in group.items() if k != "params" and k in accepted}
            groups.append(
                {**settings, **_implementation_flags(template, group, device_type), "params": params}
            )
    if not groups:
        settings = {k: v for k, v in template.defaults.items() if k in accepted}
        flags = _implementation_flags(template, template.defaults, device_type)
        groups = [{**settings, **flags, "params": list(stand_ins.values())}]
    return type(template)(groups)  # type: ignore[call-arg]  # subclasses take only params


@dataclass(frozen=True)
class StepProbe:
    """What the end of a training step allocates beyond parameters, gradients and optimizer state."""

    optimizer_state_bytes: int
    optimizer_step_workspace_bytes: int
    clip_workspace_bytes: int
    unscale_workspace_bytes: int
    grad_scaler_bytes: int
    """GradScaler's own tensors (scale, growth tracker), alive from the first scaled loss on."""


def _held_on_the_device(
    state: torch.Tensor, stand_in: torch.Tensor, group: dict[str, Any], device_type: str
) -> bool:
    """Whether a tensor of the optimizer's state lives on the device the step runs on (NOTE [step
    counts on the host])."""
    if stand_in.device.type == device_type:
        return state.device == stand_in.device
    return state.dim() > 0 or bool(group.get("fused") or group.get("capturable"))


def _state_bytes(spec: OptimizerSpec, parameters: list[torch.nn.Parameter], device_type: str) -> int:
    """Optimizer state of `parameters`, probed once per shape and parameter group on full-size (or,
    for meta, scaled) copies."""
    group_of = {
        id(p): index
        for index, group in enumerate(_template(spec, parameters).param_groups)
        for p in group["params"]
    }
    by_kind: dict[tuple[tuple[int, ...], torch.dtype, torch.device, int | None], int] = {}
    total = 0
    for parameter in parameters:
        key = (tuple(_local(parameter).shape), parameter.dtype, parameter.device, group_of.get(id(parameter)))
        if key not in by_kind:
            scale = _scale_for([parameter], META_PROBE_ELEMENTS) if parameter.is_meta else 1.0
            stand_in = _stand_in(parameter, scale)
            optimizer = _copy_optimizer(spec, {id(parameter): stand_in}, [parameter], device_type)
            optimizer.step()
            group = optimizer.param_groups[0]
            state = [
                v
                for v in optimizer.state[stand_in].values()
                if isinstance(v, torch.Tensor) and _held_on_the_device(v, stand_in, group, device_type)
            ]
            vectors = {id(v.untyped_storage()): v for v in state if v.dim() > 0}.values()
            scalars_bytes = _unique_bytes([v for v in state if v.dim() == 0], set())
            # State is elementwise but for scalars (the step count): scale only the rest, each
            # storage at the parameter's size before it is counted.
            local_elements = _local(parameter).numel()
            by_kind[key] = scalars_bytes + sum(
                counted_bytes(math.ceil(v.untyped_storage().nbytes() * local_elements / stand_in.numel()))
                for v in vectors
            )
        total += by_kind[key]
    return total


def _step_temporaries(
    spec: OptimizerSpec, parameters: list[torch.nn.Parameter], *, device_type: str, limit_elements: float
) -> int:
    """Peak temporaries of a steady optimizer step (the second) over stand-ins of `parameters`, scaled
    back up: exact at full size, an upper bound when scaled (see `_stand_in`)."""
    scale = _scale_for(parameters, limit_elements)
    stand_ins = {id(p): _stand_in(p, scale) for p in parameters}
    optimizer = _copy_optimizer(spec, stand_ins, parameters, device_type)
    tracker = LiveStorageTracker()
    tracker.track(
        [tensor for probe in stand_ins.values() for tensor in (probe, probe.grad) if tensor is not None]
    )
    with tracker:
        optimizer.step()  # the first step allocates the state
        temporaries_bytes = _temporaries(tracker, optimizer.step)
    return math.ceil(temporaries_bytes / scale)


def _optimizer_step_bytes(spec: OptimizerSpec, parameters: list[torch.nn.Parameter], device_type: str) -> int:
    """Temporaries of `optimizer.step()` as it runs on `device_type`.

    Foreach and fused steps are probed over every parameter in their groups (scaled down beyond
    `OPTIMIZER_PROBE_ELEMENTS`). A single-tensor step holds one parameter's temporaries and the
    previous one's last (Adam's `denom`), so it is probed exactly, at full size, on each of the
    largest parameters with the one before it.
    """
    template = _template(spec, parameters)
    implementations = {
        optimizer_implementation(template, group, device_type) for group in template.param_groups
    }
    if implementations != {"single-tensor"}:
        return _step_temporaries(
            spec, parameters, device_type=device_type, limit_elements=OPTIMIZER_PROBE_ELEMENTS
        )
    order = sorted(range(len(parameters)), key=lambda i: _local(parameters[i]).numel(), reverse=True)
    pair_limit = 2 * META_PROBE_ELEMENTS if any(p.is_meta for p in parameters) else math.inf
    return max(
        _step_temporaries(
            spec, parameters[max(0, i - 1) : i + 1], device_type=device_type, limit_elements=pair_limit
        )
        for i in order[:OPTIMIZER_PROBES]
    )


def probe_step_end(
    spec: OptimizerSpec, parameters: list[torch.nn.Parameter], *, step: TrainingStep, device_type: str
) -> StepProbe:
    """State and temporaries of the optimizer step, clipping and unscaling over `parameters`.

    Clipping and unscaling allocate scalars per gradient (norms, flags), not per element, so they are
    probed on the stand-ins and not scaled; the flags `unscale_` makes stay alive until
    `scaler.update()`, after the optimizer step, so they add to the later phases' temporaries.
    """
    if not parameters:
        return StepProbe(0, 0, 0, 0, 0)
    stand_ins = {id(p): _stand_in(p, _scale_for(parameters, OPTIMIZER_PROBE_ELEMENTS)) for p in parameters}
    probes = list(stand_ins.values())
    tracker = LiveStorageTracker()
    tracker.track([tensor for probe in probes for tensor in (probe, probe.grad) if tensor is not None])
    scaler_bytes = unscale_bytes = kept_bytes = clip_bytes = 0
    with tracker:
        if step.grad_scaler and spec is not None:
            optimizer = _copy_optimizer(spec, stand_ins, parameters, device_type)
            scaler = torch.amp.GradScaler(probes[0].device.type)
            scaler_bytes = _allocated(tracker, lambda: scaler.scale(torch.ones((), device=probes[0].device)))
            before_unscale = tracker.live_bytes
            unscale_bytes = _temporaries(tracker, lambda: scaler.unscale_(optimizer))
            kept_bytes = tracker.live_bytes - before_unscale
        if step.max_grad_norm is not None:
            norm = step.max_grad_norm
            clip_bytes = _temporaries(tracker, lambda: torch.nn.utils.clip_grad_norm_(probes, norm))
    if spec is None:
        return StepProbe(0, 0, clip_bytes, 0, 0)
    return StepProbe(
        optimizer_state_bytes=_state_bytes(spec, parameters, device_type),
        optimizer_step_workspace_bytes=_optimizer_step_bytes(spec, parameters, device_type) + kept_bytes,
        clip_workspace_bytes=clip_bytes + kept_bytes if step.max_grad_norm is not None else 0,
        unscale_workspace_bytes=unscale_bytes,
        grad_scaler_bytes=scaler_bytes,
    )


def _temporaries(tracker: LiveStorageTracker, run: Callable[[], object]) -> int:
    """Peak bytes above what was live before `run()`, during it (what it leaves alive included)."""
    tracker.reset_peak()
    before = tracker.live_bytes
    run()
    return max(0, tracker.peak_bytes - before)


def _allocated(tracker: LiveStorageTracker, run: Callable[[], object]) -> int:
    """Bytes `run()` leaves alive (its return value is dropped first)."""
    before = tracker.live_bytes
    run()
    return tracker.live_bytes - before


def static_bytes(
    model: torch.nn.Module,
    inputs: Any,
    *,
    gradient_bytes: int,
    optimizer: OptimizerSpec,
    step: TrainingStep | None = None,
    device_type: str | None = None,
) -> StaticBytes:
    """Parameters, buffers and inputs (each storage once), the given gradient bytes, and what the end of
    `step` allocates as probed: optimizer state and temporaries, clipping's and unscaling's. A
    GradScaler's own scale and growth tracker count with the buffers: they live as long.

    `device_type` is where the step will run ("cuda" for a plan made on the meta device for a GPU);
    by default the device of the model's parameters.
    """
    seen: set[int] = set()
    parameter_bytes = _unique_bytes(list(model.parameters()), seen)
    buffer_bytes = _unique_bytes(list(model.buffers()), seen)
    input_bytes = _unique_bytes(tensors_in(inputs), seen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if device_type is None:
        device_type = trainable[0].device.type if trainable else "cpu"
    probe = probe_step_end(optimizer, trainable, step=step or TrainingStep(), device_type=device_type)
    return StaticBytes(
        parameter_bytes=parameter_bytes,
        buffer_bytes=buffer_bytes + probe.grad_scaler_bytes,
        input_bytes=input_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=probe.optimizer_state_bytes,
        optimizer_step_workspace_bytes=probe.optimizer_step_workspace_bytes,
        accumulated_gradient_bytes=_gradient_bytes_of(trainable),
        clip_workspace_bytes=probe.clip_workspace_bytes,
        unscale_workspace_bytes=probe.unscale_workspace_bytes,
    )


def extra_static_tensors(graph_module: fx.GraphModule) -> list[torch.Tensor]:
    """Tensor attributes fetched by get_attr that are neither parameters nor buffers (constants)."""
    found = []
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            value: Any = graph_module
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def constant_bytes(graph_module: fx.GraphModule, model: torch.nn.Module) -> int:
    """Bytes of the graph's tensor constants that are not parameters or buffers of `model`."""
    seen = {id(storage_of(t)) for t in [*model.parameters(), *model.buffers()]}
    return _unique_bytes(extra_static_tensors(graph_module), seen)


def optimizer_name(optimizer: OptimizerSpec) -> str:
    """How a graph names its optimizer: a name as given, an instance by its class, or "none"."""
    if optimizer is None:
        return NO_OPTIMIZER
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    return optimizer
