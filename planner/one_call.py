"""`optimize`, `pareto` and `measure`: the torch side of the public API (imported lazily by `planner`).

`optimize` and `pareto` are `planner.profile` (planning/model.py) followed by one solve or many; the
arguments are checked before the profiling run, so a bad budget or solver name costs none. The
torch-free counterpart, for a graph captured elsewhere, is planning/graph.py (`plan_graph`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from planner.ir import BudgetKind, CostModel, MemoryCounting, Sharding, TrainingStep
from planner.planning.arguments import (
    allocator_settings_of,
    budget_and_card,
    example_call,
    memory_counting_of,
    training_step_of,
)
from planner.planning.graph import Frontier
from planner.planning.model import profile
from planner.planning.plan import Plan
from planner.profiler.cost_model import DeviceSpec
from planner.profiler.counting import counting_scope
from planner.profiler.measurement import MeasuredStep, OptimizerSpec, default_loss, measure_step
from planner.solvers import check_solver

__all__ = ["measure", "optimize", "pareto"]


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
    cost_model: CostModel | str = CostModel.MEASURED,
    device: str | DeviceSpec | None = None,
    world_size: int = 1,
    sharding: Sharding | str = Sharding.DDP,
    reshard_after_forward: bool = True,
    compile: bool = False,
    memory_counting: MemoryCounting | str = MemoryCounting.BLOCKS,
    budget_kind: BudgetKind | str | None = None,
    allocator_conf: str | None = None,
    tensor_parallel: DeviceMesh | None = None,
) -> Plan:
    """Plan activation checkpointing so one training step of `model` fits the budget:
    `planner.profile(model, example_inputs, ...)` and then `.plan(budget, solver)` on that profile.

    With `compile=True` the step planned is the one `torch.compile` (inductor) runs, and `plan.module`
    is the compiled model: the planner reads the joint graph inductor's partitioner receives, chooses
    what the compiled forward saves and what its backward recomputes, and installs that choice in the
    partitioner (compiled/optimize.py). Per-node times are then analytic (`device`, default the model's).

    For data-parallel training over `world_size` ranks, pass the per-rank example batch and
    `sharding="ddp"` (replicated state plus DDP's gradient buckets) or `"fsdp"` (state split across
    ranks, units gathered around their forward and backward); the budget is then one rank's memory
    (NOTE [FSDP2 per rank] in profiler/sharding.py). With `"fsdp"` (and measured costs) the plan is made
    by submodules, so that `plan.module` trains under FSDP2: `fully_shard` each block of `plan.module`,
    then `plan.module` (NOTE [FSDP2] in rewrite/emit.py), with the `reshard_after_forward` given here
    (fully_shard's argument: False keeps each block's parameters from its forward to its backward).
    Raises `UnsupportedModel` for a model that `fully_shard` already wraps.

    For tensor parallelism, call `optimize` inside every rank after `parallelize_module` (ColwiseParallel
    and RowwiseParallel Linears), with that rank's example batch and `tensor_parallel=mesh`, the
    DeviceMesh the model was parallelized over: each rank profiles its own shards, rank 0 solves the
    ranks' graphs merged, and every rank gets that plan (NOTE [tensor parallel plans] in
    planning/tensor_parallel.py). SequenceParallel, loss parallelism and FSDP x TP are refused.

    Per-node times are measured on the model's device (`cost_model="measured"`) or priced by FLOPs
    and bytes on a named device (`cost_model="analytic", device="h100"`), which also plans a model
    built on the meta device without allocating it.

    Without a budget, a `device` that names a card with its memory (`"h100-80gb"`, `"a100-40gb"`,
    `"rtx4090"`) gives it: the card's memory less its CUDA context and cuBLAS workspaces
    (`plan.held_back_bytes`). Every byte figure (the budget, the predicted peak, the lowest achievable
    peak) counts each tensor
    storage as CUDA's caching allocator does, in 512-byte blocks (`memory_counting="blocks"`, the
    default on every device: what `torch.cuda.max_memory_allocated` reports), or as its own bytes
    (`memory_counting="exact"`, for training on the CPU). `budget_kind` says what the budget bounds:
    `"allocated"` (the default: what `max_memory_allocated` reports, measured on an H100 within 0.73 % of
    the prediction) or `"reserved"`, what CUDA's caching allocator reserves (predicted by replaying the
    plan's allocations through a model of it, not yet calibrated: docs/memory.md). `plan.reserved` has
    the plan's predicted reserved peak either way. Compiled plans bound allocated bytes. The allocator
    is modelled with `allocator_conf`'s options (`"expandable_segments:True"`, `"max_split_size_mb:128"`),
    by default those of this process's PYTORCH_CUDA_ALLOC_CONF, which the training process should share.

    The example call is `model(*example_inputs, **example_kwargs)`, one micro-batch. `step` describes
    the training step to fit (`TrainingStep`: gradient accumulation, clipping, GradScaler, zero_grad;
    default one micro-batch, no clipping). The budget is the whole step: parameters, gradients,
    optimizer state, inputs, activations and workspace, over every micro-batch and the end of the step.
    A plan for one micro-batch refuses to run a forward while gradients are alive (`UnplannedStep`).
    `loss_fn(output) -> scalar` defaults to the sum of the output's floating tensors. Raises
    `InfeasibleBudget` (a ValueError) when no plan fits, with the lowest achievable peak, and
    `UnsupportedModel` when no capture level works. The model is left unchanged; `plan.module` shares
    its parameters, trains at the example's shapes and every smaller one within the budget, and warns
    once at a larger one (`plan.predicted_peak_bytes_for(...)` predicts any shape).
    """
    budget, card = budget_and_card(budget_gb, budget_bytes, device)
    check_solver(solver)
    counting = memory_counting_of(memory_counting)
    allocator = allocator_settings_of(allocator_conf)
    if compile:
        if tensor_parallel is not None:
            raise ValueError(
                "compile=True plans one process's compiled step; with tensor_parallel plan with "
                "compile=False (every rank gets the same eager plan)"
            )
        if budget_kind == BudgetKind.RESERVED:
            raise ValueError(
                "compile=True plans bound allocated bytes, measured on the compiled step; budget_kind="
                "'reserved' is for eager plans (pass budget_kind='allocated', or leave it out)"
            )
        with counting_scope(counting):
            plan = _optimize_compiled(
                model, example_inputs, example_kwargs, budget, optimizer, training_step_of(step), loss_fn,
                solver, device, world_size,
            )  # fmt: skip
        return on_card(plan, card)
    profiled = profile(
        model,
        example_inputs,
        example_kwargs=example_kwargs,
        optimizer=optimizer,
        step=step,
        loss_fn=loss_fn,
        cost_model=cost_model,
        device=device,
        world_size=world_size,
        sharding=sharding,
        reshard_after_forward=reshard_after_forward,
        memory_counting=counting,
        tensor_parallel=tensor_parallel,
    )
    plan = profiled.plan(budget_bytes=budget, solver=solver, budget_kind=budget_kind, allocator=allocator)
    return on_card(plan, card)


def on_card(plan: Plan, card: DeviceSpec | None) -> Plan:
    """`plan`, saying which card's memory set its budget."""
    if card is not None:
        plan.card, plan.held_back_bytes = card.name, card.held_back_bytes
    return plan


def _optimize_compiled(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    budget_bytes: int,
    optimizer: OptimizerSpec,
    step: TrainingStep,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    solver: str,
    device: str | DeviceSpec | None,
    world_size: int,
) -> Plan:
    """`optimize(..., compile=True)`: the compiled step (compiled/optimize.py), one rank."""
    from planner.compiled.optimize import optimize_compiled

    if world_size != 1:
        raise ValueError(
            f"compile=True plans one process's compiled step; world_size={world_size} is not supported with "
            "it yet: plan with compile=False and world_size, then torch.compile(plan.module)"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return optimize_compiled(
        model,
        example_call(example_inputs, example_kwargs),
        dict(example_kwargs or {}),
        budget_bytes=budget_bytes,
        optimizer=optimizer,
        step=step,
        loss_fn=loss_fn or default_loss,
        solver=solver,
        device=device,
    )


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
    cost_model: CostModel | str = CostModel.MEASURED,
    device: str | DeviceSpec | None = None,
    world_size: int = 1,
    sharding: Sharding | str = Sharding.DDP,
    reshard_after_forward: bool = True,
    memory_counting: MemoryCounting | str = MemoryCounting.BLOCKS,
    tensor_parallel: DeviceMesh | None = None,
) -> Frontier:
    """Predicted (peak, recompute) frontier over budgets, from one captured and profiled graph.

    Budgets are `budgets_bytes`, or `points` budgets from the lowest achievable peak to the peak
    without checkpointing. `frontier.plot(path)` draws it. `planner.profile(...).pareto(...)` is the
    same, keeping the profile to plan one of the budgets afterwards. Under tensor parallelism
    (`tensor_parallel=mesh`) each rank's frontier is its own prediction; no plan is agreed on.
    """
    check_solver(solver)
    profiled = profile(
        model,
        example_inputs,
        example_kwargs=example_kwargs,
        optimizer=optimizer,
        step=step,
        loss_fn=loss_fn,
        cost_model=cost_model,
        device=device,
        world_size=world_size,
        sharding=sharding,
        reshard_after_forward=reshard_after_forward,
        memory_counting=memory_counting,
        tensor_parallel=tensor_parallel,
    )
    return profiled.pareto(points=points, budgets_bytes=budgets_bytes, solver=solver)


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
    The peak is reported in 512-byte blocks (`peak_bytes`, as a GPU counts) and in exact bytes
    (`exact_peak_bytes`); `peak_in(plan.graph.memory_counting)` is the one to compare a plan with.
    Trains `model`."""
    return measure_step(
        model,
        example_call(example_inputs, example_kwargs),
        example_kwargs=example_kwargs,
        loss_fn=loss_fn or default_loss,
        optimizer=optimizer,
        step=training_step_of(step),
        timed_steps=timed_steps,
    )
