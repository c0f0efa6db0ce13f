"""Memory that no checkpoint schedule changes: parameters, buffers, inputs, gradients, and the
optimizer's state and step temporaries.

Storages are counted once however many tensors share them (tied weights). The optimizer is not
modelled from its formulas: two real steps run over zero-filled copies of the parameters (one per
shape for state, the largest few for temporaries), and parameters on the meta device are probed on
small CPU stand-ins and scaled, since optimizer state and temporaries are elementwise.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import fx

from planner.ir import StaticBytes
from planner.measurement import LiveStorageTracker, OptimizerSpec, make_optimizer, tensors_in

__all__ = ["constant_bytes", "extra_static_tensors", "optimizer_name", "static_bytes"]

META_PROBE_ELEMENTS = 2**16
"""Elements of the CPU stand-in for a meta parameter when probing the optimizer."""
OPTIMIZER_PROBES = 3
"""Largest parameters whose optimizer step is probed for temporaries."""


def _unique_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += storage.nbytes()
    return total


def _optimizer_bytes(spec: OptimizerSpec, parameters: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(state bytes, step workspace bytes) of the optimizer, probed on copies of a few parameters.

    State is probed once per parameter shape. Workspace is probed on the largest parameters, each with
    the parameter before it: a for-loop optimizer still holds the previous parameter's temporaries
    (Adam's `denom`) while it works on the next one.
    """
    if spec is None or not parameters:
        return 0, 0
    state_by_shape: dict[tuple[tuple[int, ...], torch.dtype, torch.device], int] = {}
    for parameter in parameters:
        key = (tuple(parameter.shape), parameter.dtype, parameter.device)
        if key not in state_by_shape:
            state_by_shape[key] = _probe_optimizer(spec, [parameter])[0]
    state_bytes = sum(state_by_shape[(tuple(p.shape), p.dtype, p.device)] for p in parameters)
    order = sorted(range(len(parameters)), key=lambda i: parameters[i].numel(), reverse=True)
    workspace_bytes = max(
        _probe_optimizer(spec, parameters[max(0, i - 1) : i + 1])[1] for i in order[:OPTIMIZER_PROBES]
    )
    return state_bytes, workspace_bytes


def _probe_optimizer(spec: OptimizerSpec, parameters: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(state bytes, peak temporaries) of two optimizer steps over zero-filled copies of `parameters`.

    Parameters on the meta device are probed on small CPU copies and the result scaled by size:
    optimizer state and temporaries are elementwise, so they grow linearly with the parameter.
    """
    if any(p.is_meta for p in parameters):
        small = [
            torch.nn.Parameter(torch.zeros(min(p.numel(), META_PROBE_ELEMENTS), dtype=p.dtype))
            for p in parameters
        ]
        state_bytes, workspace_bytes = _probe_optimizer(spec, small)
        scale = sum(p.numel() for p in parameters) / sum(p.numel() for p in small)
        return math.ceil(state_bytes * scale), math.ceil(workspace_bytes * scale)
    probes = [torch.nn.Parameter(torch.zeros_like(p)) for p in parameters]
    for probe in probes:
        probe.grad = torch.zeros_like(probe)
    if isinstance(spec, torch.optim.Optimizer):
        accepted = inspect.signature(type(spec).__init__).parameters
        optimizer = type(spec)(probes, **{k: v for k, v in spec.defaults.items() if k in accepted})
    else:
        built = make_optimizer(spec, probes)
        assert built is not None
        optimizer = built
    tracker = LiveStorageTracker()
    tracker.track([tensor for probe in probes for tensor in (probe, probe.grad) if tensor is not None])
    with tracker:
        optimizer.step()
        optimizer.step()
    state = [
        value
        for probe in probes
        for value in optimizer.state[probe].values()
        if isinstance(value, torch.Tensor)
    ]
    state_bytes = _unique_bytes(state, set())
    base_bytes = sum(2 * probe.untyped_storage().nbytes() for probe in probes) + state_bytes
    return state_bytes, max(0, tracker.peak_bytes - base_bytes)


def static_bytes(
    model: torch.nn.Module, inputs: Any, *, gradient_bytes: int, optimizer: OptimizerSpec
) -> StaticBytes:
    """Parameters, buffers and inputs (each storage once), the given gradient bytes, and the optimizer's
    state and step temporaries as probed."""
    seen: set[int] = set()
    parameter_bytes = _unique_bytes(list(model.parameters()), seen)
    buffer_bytes = _unique_bytes(list(model.buffers()), seen)
    input_bytes = _unique_bytes(tensors_in(inputs), seen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    state_bytes, step_workspace_bytes = _optimizer_bytes(optimizer, trainable)
    return StaticBytes(
        parameter_bytes=parameter_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        gradient_bytes=gradient_bytes,
        optimizer_state_bytes=state_bytes,
        optimizer_step_workspace_bytes=step_workspace_bytes,
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
    seen = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    return _unique_bytes(extra_static_tensors(graph_module), seen)


def optimizer_name(optimizer: OptimizerSpec) -> str:
    """How a graph names its optimizer: a name as given, an instance by its class, or "none"."""
    if optimizer is None:
        return "none"
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    return optimizer
