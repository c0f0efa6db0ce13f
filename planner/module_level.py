"""The last level of the capture chain: plan a model by its submodules, running its forward as written.

Why it exists: some root forwards cannot be traced by torch.fx or torch.export (Python control flow
on tensor values, hooks that export would inline). Their submodules can still be checkpointed one at
a time, as `gradient_checkpointing_enable` does, and the planner can still choose which ones from a
measured step. `optimize(..., sharding="fsdp")` plans here directly, because FSDP2's `fully_shard` needs
its blocks called as modules (NOTE [FSDP2] in rewrite.py). At this level the root's forward runs eagerly,
and its *units* are the nodes of the activation graph:

- Units are the root's children, with containers (ModuleList/ModuleDict/Sequential) replaced by their
  children, and a unit that holds most of the parameters replaced by its children too, so that a
  decoder's blocks become units rather than the decoder (`candidate_units`).
- One profiled step with forward hooks on the units splits the forward into unit calls and the glue
  between them (the root's own code): each is a node. A unit node reads its arguments; a glue node
  reads the storages it frees (so liveness is the eager run's); saved tensors are attributed by
  `saved_tensors_hooks`; backward is split by pre-hooks on the grad_fns of each unit's outputs.
  Workspace is calibrated against the simulator, as in graph_build (see NOTE [measured residuals]).
- NOTE [returned storages]: the storages a unit returns are created by the glue node after its call,
  where the root's code receives them. A cut (solvers/chain.py) needs every storage crossing it to be
  made by the node just before it; were the outputs the unit's own, the glue between two units that
  the root chains directly (`x = block(x)`, a glue node that makes nothing) would stand between them
  and their reader, and no region could start at the second unit. Checkpointed, a unit's outputs
  outlive it anyway (checkpoint returns them); inside the call they are measured in its workspace,
  which the prediction of its replay also counts, so that prediction is high by up to the outputs'
  bytes (checkpoint's replay stops at the last saved tensor, before it remakes them).
- Glue is never checkpointed, and a unit only when it is called once per step and carries no hooks
  (a replay would run them again), so a checkpointed region is exactly one unit call.
  `rewrite_units` wraps those units in checkpoint on a copy of the module tree along their paths,
  sharing every parameter, buffer and untouched submodule with the model.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from planner.capture import has_hooks
from planner.ir import ActivationGraph, Node, Phase, Schedule, TrainingStep
from planner.measurement import LiveStorageTracker, OptimizerSpec, end_autocast_forward, tensors_in
from planner.rewrite import CheckpointedUnit, planned_class
from planner.simulate import simulate, store_everything
from planner.static_memory import optimizer_name, static_bytes

__all__ = ["MODULE_LEVEL", "UnitProfile", "candidate_units", "profile_units", "rewrite_units"]

MODULE_LEVEL = "module"
"""`Capture.path` and `Plan.capture` of this level."""
DOMINANT_SHARE = 0.5
"""A unit with more than this share of the parameters is split into its children."""
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _parameter_count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def candidate_units(model: nn.Module) -> list[str]:
    """Qualified names of the submodules that become nodes (see the module docstring)."""
    total = max(1, _parameter_count(model))
    units = [name for name, _ in model.named_children()]
    changed = True
    while changed:
        changed = False
        expanded: list[str] = []
        for name in units:
            module = model.get_submodule(name)
            children = [f"{name}.{child}" for child, _ in module.named_children()]
            dominant = _parameter_count(module) > DOMINANT_SHARE * total
            if children and (isinstance(module, CONTAINERS) or dominant):
                expanded += children
                changed = True
            else:
                expanded.append(name)
        units = expanded
    return units


@dataclass
class _Segment:
    """A unit call or the glue between two, as the profiled step saw it."""

    name: str
    module_path: str
    is_unit: bool
    creates: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)
    saves_anything: bool = False
    forward_peak_bytes: int = 0
    backward_peak_bytes: int | None = None
    parameter_gradient_bytes: int = 0
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    checkpointable: bool = False


class _NamingTracker(LiveStorageTracker):
    """Live-storage tracker that names activation storages and notes in which segment each is freed."""

    def __init__(self, static: list[torch.Tensor]) -> None:
        super().__init__()
        self.track(static)
        self.static_keys = {id(t.untyped_storage()) for t in static}
        self.names: dict[int, str] = {}
        self.storage_bytes: dict[str, int] = {}
        self.current: _Segment | None = None
        self.made_in_current: set[str] = set()

    def name_of(self, tensor: torch.Tensor) -> str | None:
        storage = tensor.untyped_storage()
        if id(storage) in self.static_keys or storage.nbytes() == 0:
            return None
        if id(storage) not in self.names:
            name = f"s{len(self.storage_bytes)}"
            self.names[id(storage)] = name
            self.storage_bytes[name] = storage.nbytes()
            if self.current is not None:
                self.current.creates.append(name)
            weakref.finalize(storage, self._freed, id(storage), name)
        return self.names[id(storage)]

    def _freed(self, key: int, name: str) -> None:
        self.names.pop(key, None)
        if self.current is not None and name not in self.current.reads:
            self.current.reads.append(name)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = super().__torch_dispatch__(func, types, args, kwargs)
        if self.current is not None:
            for tensor in tensors_in(output):
                self.name_of(tensor)
        return output


@dataclass
class UnitProfile:
    """The module-level activation graph and the units a plan may checkpoint."""

    graph: ActivationGraph
    units: tuple[str, ...]


class _Profiler:
    """Hooks that cut one eager training step into unit and glue segments."""

    def __init__(self, model: nn.Module, units: list[str], tracker: _NamingTracker) -> None:
        self.model = model
        self.units = units
        self.hooked = {name for name in units if has_hooks(model.get_submodule(name))}
        """Units with the user's hooks, found before the profiler adds its own."""
        self.tracker = tracker
        self.segments: list[_Segment] = []
        self.calls: dict[str, int] = {}
        self.grad_fn_owner: dict[int, _Segment] = {}
        self.started = 0.0
        self.backward_current: _Segment | None = None
        self.backward_opened = 0.0
        self.open_glue()

    def _open(self, segment: _Segment) -> None:
        self._close()
        self.segments.append(segment)
        self.tracker.current = segment
        self.tracker.reset_peak()
        self.started = time.perf_counter()

    def _close(self) -> None:
        segment = self.tracker.current
        if segment is not None:
            segment.forward_peak_bytes = self.tracker.peak_bytes
            segment.forward_ms = (time.perf_counter() - self.started) * 1e3
            alive = set(self.tracker.names.values())
            segment.creates = [storage for storage in segment.creates if storage in alive]
        self.tracker.current = None

    def open_glue(self) -> None:
        self._open(_Segment(name=f"glue_{len(self.segments)}", module_path="", is_unit=False))

    def before_unit(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        segment = _Segment(
            name=f"{name.replace('.', '_')}_{self.calls[name]}",
            module_path=name,
            is_unit=True,
            checkpointable=name not in self.hooked,
        )
        self._open(segment)
        for tensor in tensors_in((args, kwargs)):
            storage = self.tracker.name_of(tensor)
            if storage is not None and storage not in segment.reads:
                segment.reads.append(storage)
        segment.creates.clear()  # arguments were made before the call

    def after_unit(self, output: Any) -> None:
        segment = self.tracker.current
        assert segment is not None and segment.is_unit
        returned: list[str] = []
        for tensor in tensors_in(output):
            if tensor.grad_fn is not None and id(tensor.grad_fn) not in self.grad_fn_owner:
                self.grad_fn_owner[id(tensor.grad_fn)] = segment
                tensor.grad_fn.register_prehook(lambda _grads, segment=segment: self.open_backward(segment))
            storage = self.tracker.name_of(tensor)
            if storage in segment.creates and storage not in returned:
                returned.append(storage)
        self.open_glue()
        glue = self.tracker.current
        assert glue is not None
        segment.creates = [storage for storage in segment.creates if storage not in returned]
        glue.creates[:0] = returned  # see NOTE [returned storages]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        segment = self.tracker.current
        if segment is not None:
            segment.saves_anything = True
            storage = self.tracker.name_of(tensor)
            if storage is not None and storage not in segment.saves:
                segment.saves.append(storage)
        return tensor

    def open_backward(self, segment: _Segment) -> None:
        self.close_backward()
        self.tracker.reset_peak()
        self.backward_current = segment
        self.backward_opened = time.perf_counter()

    def close_backward(self) -> None:
        segment = self.backward_current
        if segment is not None:
            segment.backward_peak_bytes = max(segment.backward_peak_bytes or 0, self.tracker.peak_bytes)
            segment.backward_ms += (time.perf_counter() - self.backward_opened) * 1e3
        self.backward_current = None


def _known_storages_only(segments: list[_Segment]) -> list[_Segment]:
    """Drop from `reads` what no segment outlived: temporaries made and freed inside one segment."""
    made = {storage for segment in segments for storage in segment.creates}
    for segment in segments:
        segment.reads = [storage for storage in segment.reads if storage in made]
    return segments


def _register(profiler: _Profiler) -> list[Any]:
    handles = []
    for name in profiler.units:
        module = profiler.model.get_submodule(name)
        handles.append(
            module.register_forward_pre_hook(
                lambda module, args, kwargs, name=name: profiler.before_unit(name, module, args, kwargs),
                with_kwargs=True,
            )
        )
        handles.append(module.register_forward_hook(lambda module, args, output: profiler.after_unit(output)))
    return handles


def _to_nodes(segments: list[_Segment], unit_calls: dict[str, int]) -> list[Node]:
    return [
        Node(
            name=segment.name,
            op="module" if segment.is_unit else "glue",
            module_path=segment.module_path,
            inputs=(),
            creates=tuple(segment.creates),
            reads=tuple(segment.reads),
            saves=tuple(segment.saves),
            saves_anything=segment.saves_anything,
            forward_ms=segment.forward_ms,
            backward_ms=segment.backward_ms,
            forward_workspace_bytes=0,
            backward_workspace_bytes=0,
            parameter_gradient_bytes=segment.parameter_gradient_bytes,
            checkpointable=segment.checkpointable and unit_calls.get(segment.module_path, 0) == 1,
        )
        for segment in segments
    ]


def _calibrate(graph: ActivationGraph, segments: list[_Segment]) -> ActivationGraph:
    """Workspace = measured peak minus the simulator's prediction without it (NOTE [measured residuals])."""
    trace = simulate(graph, store_everything(graph)).trace
    forward = {step.node: step.live_bytes for step in trace if step.phase is Phase.FORWARD}
    backward = {step.node: step.live_bytes for step in trace if step.phase is Phase.BACKWARD}
    nodes = []
    for node, segment in zip(graph.nodes, segments, strict=True):
        backward_workspace = 0
        if segment.backward_peak_bytes is not None:
            backward_workspace = max(0, segment.backward_peak_bytes - backward[node.name])
        nodes.append(
            dataclasses.replace(
                node,
                forward_workspace_bytes=max(0, segment.forward_peak_bytes - forward[node.name]),
                backward_workspace_bytes=backward_workspace,
            )
        )
    return dataclasses.replace(graph, nodes=tuple(nodes))


def profile_units(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: OptimizerSpec,
    step: TrainingStep | None = None,
) -> UnitProfile:
    """Profile one eager training step of `model` cut at its units (model and RNG left unchanged)."""
    units = candidate_units(model)
    static_tensors = [*model.parameters(), *model.buffers(), *tensors_in((args, kwargs))]
    tracker = _NamingTracker(static_tensors)
    profiler = _Profiler(model, units, tracker)
    parameters = [p for p in model.parameters() if p.requires_grad]
    handles = _register(profiler)
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]

    def on_gradient(gradient: torch.Tensor) -> None:
        if profiler.backward_current is not None:
            profiler.backward_current.parameter_gradient_bytes += gradient.untyped_storage().nbytes()

    handles += [parameter.register_hook(on_gradient) for parameter in parameters]
    try:
        with torch.random.fork_rng(devices=[]), tracker:
            with torch.autograd.graph.saved_tensors_hooks(profiler.pack, lambda tensor: tensor):
                output = model(*args, **kwargs)
                profiler._open(_Segment(name="loss", module_path="", is_unit=False))
                loss = loss_fn(output)
                del output
                end_autocast_forward()
            profiler._close()
            torch.autograd.grad(loss, parameters, allow_unused=True)
            profiler.close_backward()
            del loss
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    segments = _known_storages_only(profiler.segments)
    gradient_bytes = sum(segment.parameter_gradient_bytes for segment in segments)
    static = static_bytes(
        model, (args, kwargs), gradient_bytes=gradient_bytes, optimizer=optimizer, step=step
    )
    profiled = ActivationGraph(
        nodes=tuple(_to_nodes(segments, profiler.calls)),
        storage_bytes=dict(tracker.storage_bytes),
        static=dataclasses.replace(static, optimizer_state_bytes=0),
        capture=MODULE_LEVEL,
        optimizer=optimizer_name(optimizer),
    )
    calibrated = _calibrate(profiled, segments)
    return UnitProfile(graph=dataclasses.replace(calibrated, static=static), units=tuple(units))


def rewrite_units(model: nn.Module, graph: ActivationGraph, schedule: Schedule) -> nn.Module:
    """A copy of `model`'s module tree in which the checkpointed units run under checkpoint.

    Only the modules on the paths to those units are copied (shallow: parameters, buffers and other
    submodules stay the model's own); the root passes for the model's class (NOTE [drop-in] in
    rewrite.py).
    """
    assert all(region.stop - region.start == 1 for region in schedule.checkpointed), "glue separates units"
    paths = [graph.nodes[region.start].module_path for region in schedule.checkpointed]
    planned = copy.copy(model)
    planned.__class__ = planned_class(type(model), runs_graph=False)
    planned._modules = dict(model._modules)
    for path in paths:
        parent = planned
        parts = path.split(".")
        for part in parts[:-1]:
            child = copy.copy(parent._modules[part])
            assert child is not None
            child._modules = dict(child._modules)
            parent._modules[part] = child
            parent = child
        unit = parent._modules[parts[-1]]
        assert unit is not None
        parent._modules[parts[-1]] = CheckpointedUnit.wrap(unit)
    return planned
