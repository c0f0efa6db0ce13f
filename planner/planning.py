"""`optimize`, `pareto` and `measure`: the torch side of the public API (imported lazily by `planner`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from planner.capture import Capture, capture
from planner.errors import GIB, UnsupportedModel
from planner.graph_build import build_activation_graph
from planner.ir import ActivationGraph, TrainingStep
from planner.measurement import MeasuredStep, OptimizerSpec, default_loss, measure_step, tensors_in
from planner.module_level import profile_units, rewrite_units
from planner.plan import Plan
from planner.cost_model import DeviceSpec
from planner.rewrite import fully_sharded_modules, guard_gradients, rewrite
from planner.sharding import Sharding, shard_graph
from planner.simulate import for_training_step
from planner.solving import Frontier, pareto_frontier, plan_graph

__all__ = ["fsdp_unit_bytes", "measure", "optimize", "pareto", "replan"]

log = logging.getLogger(__name__)


def _budget_bytes(budget_gb: float | None, budget_bytes: int | None) -> int:
    if (budget_gb is None) == (budget_bytes is None):
        raise ValueError(
            f"give exactly one of budget_gb (GiB, 2**30 bytes) or budget_bytes; got budget_gb={budget_gb!r}, "
            f"budget_bytes={budget_bytes!r}"
        )
    if budget_gb is not None:
        if (
            isinstance(budget_gb, bool)
            or not isinstance(budget_gb, int | float)
            or not math.isfinite(budget_gb)
        ):
            raise TypeError(f"budget_gb must be a finite number of GiB, got {budget_gb!r}")
        if budget_gb <= 0:
            raise ValueError(f"budget_gb must be positive, got {budget_gb!r}")
        return int(budget_gb * GIB)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__} {budget_bytes!r}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
    return budget_bytes


def _example_inputs(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, Sequence) and not isinstance(example_inputs, str):
        if not any(isinstance(value, torch.Tensor) for value in example_inputs):
            raise TypeError("example_inputs holds no tensor; pass the tensors the model's forward takes")
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple/list of the forward's positional arguments, "
        f"got {type(example_inputs).__name__}; pass keyword arguments as example_kwargs={{...}}"
    )


def _example_call(example_inputs: Any, example_kwargs: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """Positional example inputs, checked; with keyword inputs, positional ones may be empty."""
    if example_kwargs is None:
        return _example_inputs(example_inputs)
    if not isinstance(example_kwargs, Mapping):
        raise TypeError(
            f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}"
        )
    if example_inputs is None or (isinstance(example_inputs, Sequence) and len(example_inputs) == 0):
        if not tensors_in(example_kwargs):
            raise TypeError("example_kwargs holds no tensor; pass the tensors the model's forward takes")
        return ()
    return _example_inputs(example_inputs)


def optimize(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    budget_gb: float | None = None,
    budget_bytes: int | None = None,
    optimizer: OptimizerSpec = "adam",
    step: TrainingStep | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver: str = "auto",
    cost_model: str = "measured",
    device: str | DeviceSpec | None = None,
    world_size: int = 1,
    sharding: str = "ddp",
) -> Plan:
    """Plan activation checkpointing so one training step of `model` fits the budget.

    For data-parallel training over `world_size` ranks, pass the per-rank example batch and
    `sharding="ddp"` (replicated state plus DDP's gradient buckets) or `"fsdp"` (state split across
    ranks, one block gathered at a time); the budget is then one rank's memory (see sharding.py).
    With `"fsdp"` (and measured costs) the plan is made by submodules, so that `plan.module` trains
    under FSDP2: `fully_shard` each block of `plan.module`, then `plan.module` (NOTE [FSDP2] in
    rewrite.py). Raises `UnsupportedModel` for a model that `fully_shard` already wraps.

    Per-node times are measured on the model's device (`cost_model="measured"`) or priced by FLOPs
    and bytes on a named device (`cost_model="analytic", device="h100"`), which also plans a model
    built on the meta device without allocating it.

    The example call is `model(*example_inputs, **example_kwargs)`, one micro-batch. `step` describes
    the training step to fit (`TrainingStep`: gradient accumulation, clipping, GradScaler, zero_grad;
    default one micro-batch, no clipping). The budget is the whole step: parameters, gradients,
    optimizer state, inputs, activations and workspace, over every micro-batch and the end of the step.
    A plan for one micro-batch refuses to run a forward while gradients are alive (`UnplannedStep`).
    `loss_fn(output) -> scalar` defaults to the sum of the output's floating tensors. Raises
    `InfeasibleBudget` (a ValueError) when no plan fits, with the lowest achievable peak, and
    `UnsupportedModel` when no capture level works. The model is left unchanged; `plan.module` shares
    its parameters.
    """
    budget = _budget_bytes(budget_gb, budget_bytes)
    placement = _sharding(world_size, sharding)
    step = _training_step(step)
    _refuse_sharded_model(model)
    by_units = functools.partial(
        _plan_by_units,
        model,
        example_inputs,
        example_kwargs,
        optimizer=optimizer,
        step=step,
        loss_fn=loss_fn,
        budget_bytes=budget,
        solver=solver,
        world_size=world_size,
        placement=placement,
    )
    if placement is Sharding.FSDP and cost_model == "measured":
        return by_units(reason=FSDP_UNITS_REASON)
    try:
        captured, graph = _capture_and_profile(
            model,
            example_inputs,
            example_kwargs,
            optimizer=optimizer,
            step=step,
            loss_fn=loss_fn,
            cost_model=cost_model,
            device=device,
        )
    except UnsupportedModel as unsupported:
        if cost_model != "measured":
            raise
        log.info("%s; planning by submodules", unsupported)
        return by_units(reason=str(unsupported))
    graph = shard_graph(
        graph, world_size=world_size, sharding=placement, unit_parameter_bytes=fsdp_unit_bytes(model)
    )
    graph = for_training_step(graph, step)
    plan = plan_graph(graph, budget_bytes=budget, solver=solver)
    plan.rewriter = functools.partial(rewrite, model, captured.graph_module, graph, call=captured.call)
    plan.module = guard_gradients(plan.rewriter(plan.schedule), step)
    return plan


def _training_step(step: TrainingStep | None) -> TrainingStep:
    """The checked `step` argument: a TrainingStep, or None for one micro-batch."""
    if step is None:
        return TrainingStep()
    if not isinstance(step, TrainingStep):
        raise TypeError(
            f"step must be a planner.TrainingStep, got {type(step).__name__} {step!r}; e.g. "
            "step=planner.TrainingStep(accumulation_steps=4, max_grad_norm=1.0)"
        )
    return step


def replan(
    plan: Plan, *, budget_gb: float | None = None, budget_bytes: int | None = None, solver: str = "auto"
) -> Plan:
    """`plan.replan`: solve `plan.graph` again and rewrite the same model with the new schedule."""
    if plan.rewriter is None:
        raise ValueError(
            "this plan has no model to rewrite (it was loaded from JSON or planned by submodules); "
            "call planner.optimize(model, ...) with the new budget or solver instead"
        )
    replanned = plan_graph(plan.graph, budget_bytes=_budget_bytes(budget_gb, budget_bytes), solver=solver)
    replanned.rewriter = plan.rewriter
    replanned.module = guard_gradients(plan.rewriter(replanned.schedule), plan.graph.step)
    return replanned


FSDP_UNITS_REASON = "sharding='fsdp' plans by submodules, so that fully_shard's units run as module calls"
"""Why FSDP plans skip FX and torch.export (see NOTE [FSDP2] in rewrite.py)."""
FSDP_CAPTURE_NOTE = "fsdp units"
"""Appended to `Plan.capture` of a plan made for FSDP: "module (fsdp units)"."""


def _plan_by_units(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    *,
    reason: str,
    optimizer: OptimizerSpec,
    step: TrainingStep,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    budget_bytes: int,
    solver: str,
    world_size: int,
    placement: Sharding,
) -> Plan:
    """Plan at the module level (module_level.py); `reason` says why the finer levels were not used."""
    graph = _profile_units(model, example_inputs, example_kwargs, reason, optimizer, step, loss_fn)
    if placement is Sharding.FSDP:
        graph = dataclasses.replace(graph, capture=f"{graph.capture} ({FSDP_CAPTURE_NOTE})")
    graph = shard_graph(
        graph, world_size=world_size, sharding=placement, unit_parameter_bytes=fsdp_unit_bytes(model)
    )
    graph = for_training_step(graph, step)
    plan = plan_graph(graph, budget_bytes=budget_bytes, solver=solver)
    plan.module = guard_gradients(rewrite_units(model, graph, plan.schedule), step)
    return plan


def _refuse_sharded_model(model: torch.nn.Module) -> None:
    """Profiling a model that fully_shard already wraps would plan DTensor shards and run collectives."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sharded = fully_sharded_modules(model)
    if sharded:
        raise UnsupportedModel(
            f"fully_shard (FSDP2) already wraps {sharded[0] or 'the model'!r}: plan the unsharded model. "
            "Call plan = planner.optimize(model, ..., sharding='fsdp') first, then fully_shard each block "
            "of plan.module and plan.module itself."
        )


def _profile_units(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    reason: str,
    optimizer: OptimizerSpec,
    step: TrainingStep,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> ActivationGraph:
    """The module level of the capture chain (module_level.py), used for `reason`."""
    inputs = _example_call(example_inputs, example_kwargs)
    profile = profile_units(
        model, inputs, example_kwargs or {}, loss_fn=loss_fn or default_loss, optimizer=optimizer, step=step
    )
    if not any(node.checkpointable for node in profile.graph.nodes):
        raise UnsupportedModel(
            f"{reason}; and the module level found no submodule to checkpoint among "
            f"{list(profile.units)[:6]} (one must be called once per step and carry no hooks)"
        )
    return profile.graph


def _sharding(world_size: int, sharding: str) -> Sharding:
    """The checked `world_size` and `sharding` arguments of `optimize`."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (ranks of data parallelism), got {world_size!r}")
    try:
        return Sharding(sharding)
    except ValueError as error:
        choices = [member.value for member in Sharding]
        raise ValueError(f"sharding={sharding!r} is not known; use one of {choices}") from error


def fsdp_unit_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes of the largest unit FSDP gathers at once: a block of the model's longest
    ModuleList/Sequential (where one calls `fully_shard` per block), or the parameters outside the
    blocks, which the root unit holds (the whole model when it has no block stack)."""
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList | torch.nn.Sequential)]
    blocks = list(max(stacks, key=len)) if stacks else []
    seen: set[int] = set()
    block_bytes = [_parameter_bytes(block, seen) for block in blocks]
    rest_bytes = _parameter_bytes(model, seen)
    return max([*block_bytes, rest_bytes])


def _parameter_bytes(module: torch.nn.Module, seen: set[int]) -> int:
    """Bytes of `module`'s parameters not already in `seen` (tied weights count once)."""
    total = 0
    for parameter in module.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel() * parameter.element_size()
    return total


def pareto(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    points: int = 8,
    budgets_bytes: Sequence[int] | None = None,
    optimizer: OptimizerSpec = "adam",
    step: TrainingStep | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver: str = "auto",
    cost_model: str = "measured",
    device: str | DeviceSpec | None = None,
) -> Frontier:
    """Predicted (peak, recompute) frontier over budgets, from one captured and profiled graph.

    Budgets are `budgets_bytes`, or `points` budgets from the lowest achievable peak to the peak
    without checkpointing. `frontier.plot(path)` draws it.
    """
    step = _training_step(step)
    _, graph = _capture_and_profile(
        model,
        example_inputs,
        example_kwargs,
        optimizer=optimizer,
        step=step,
        loss_fn=loss_fn,
        cost_model=cost_model,
        device=device,
    )
    graph = for_training_step(graph, step)
    return pareto_frontier(graph, budgets_bytes=budgets_bytes, points=points, solver=solver)


def _capture_and_profile(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    *,
    optimizer: OptimizerSpec,
    step: TrainingStep,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    cost_model: str,
    device: str | DeviceSpec | None,
) -> tuple[Capture, ActivationGraph]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = _example_call(example_inputs, example_kwargs)
    started = time.perf_counter()
    captured = capture(model, inputs, example_kwargs)
    log.info("captured %d nodes by %s", len(captured.graph_module.graph.nodes), captured.path)
    graph = build_activation_graph(
        captured,
        model,
        captured.inputs,
        loss_fn=loss_fn or default_loss,
        optimizer=optimizer,
        step=step,
        cost_model=cost_model,
        device=device,
    )
    log.info("profiled %d nodes in %.1f s", len(graph.nodes), time.perf_counter() - started)
    return captured, graph


def measure(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    optimizer: OptimizerSpec = "adam",
    step: TrainingStep | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    timed_steps: int = 0,
) -> MeasuredStep:
    """Measured peak memory (and optionally step time) of two real training steps, each as `step`
    describes it (the same argument `optimize` takes; every micro-batch uses the example inputs).
    Trains `model`."""
    return measure_step(
        model,
        _example_call(example_inputs, example_kwargs),
        example_kwargs=example_kwargs,
        loss_fn=loss_fn or default_loss,
        optimizer=optimizer,
        step=_training_step(step),
        timed_steps=timed_steps,
    )
