"""Plans for a model that `parallelize_module` already split across ranks (tensor parallelism).

Why it exists: a tensor parallel model runs collectives inside its forward (the all-reduce after each
row-wise Linear) and, under a checkpoint, again inside its backward when a region is recomputed. Every
rank of the tensor parallel group must therefore run the same regions in the same order, or one rank
waits in a collective the others never start. Each rank profiles its own step (its own shards, measured
where it runs, NOTE [tensor parallel plans]), so measured node times differ between ranks and a solver
could choose differently on each; here rank 0 of the group solves and broadcasts the schedule, and every
rank predicts that schedule on its own graph. This module also refuses the tensor parallel layouts that
are not planned yet, naming what to do instead.

    model = parallelize_module(model, tp_mesh, {...ColwiseParallel()/RowwiseParallel()...})
    plan = planner.optimize(model, (tokens,), budget_bytes=..., tensor_parallel=tp_mesh)  # on every rank

NOTE [tensor parallel plans]: the planner plans the parallelized module inside each rank, as it runs.
What it relies on, read in torch/distributed/tensor/parallel/style.py and tensor/_api.py (torch 2.13):
- `ColwiseParallel` and `RowwiseParallel` replace a Linear's weight (and bias) by DTensor parameters
  holding this rank's shard (`_partition_linear_fn`: Shard(0) column-wise, Shard(1) row-wise, a
  row-wise bias Replicate), and wrap the Linear in a forward pre-hook and a forward hook
  (`distribute_module` registers `_prepare_input_fn` and `_prepare_output_fn`): the input becomes a
  DTensor by `DTensor.from_local` (a view, no copy), and the output is redistributed to
  `output_layouts` (row-wise: Partial -> Replicate, a `_c10d_functional.all_reduce` on plain tensors
  into a new buffer) and, with `use_local_output=True` (the default), handed on as a plain tensor.
  So between the Linears the model's own code (attention over its heads/k local heads, the SwiGLU
  product) runs on plain local tensors, and fx traces the Linears as module calls, hooks included.
- The counting instruments count a DTensor by its local shard (NOTE [wrapper subclasses] in
  profiler/counting.py), so the profiled graph holds this rank's bytes: parameters, gradients and
  Adam state at 1/k of the split Linears, the activations of local heads and hidden units, and the
  all-reduce's output buffer as the output of the row-wise Linear's call.
- A checkpointed region that holds a row-wise Linear runs its all-reduce again when it is recomputed
  in backward. That is correct (the recomputed output equals the first) as long as every rank
  recomputes the same regions at the same point of backward: one schedule for the group (rank 0's).
- Not planned yet, and refused: `SequenceParallel` (it replicates norm weights as DTensors and hands
  DTensors between modules, `use_local_output=False`), any module's output left a DTensor
  (`use_local_output=False`, which loss parallelism needs for the logits), DTensor parameters of other
  modules than Linear and Embedding, and parameters on a mesh of more than one dimension (FSDP x TP).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.errors import PlannerError, UnsupportedModel
from planner.ir import ActivationGraph
from planner.planning.plan import Plan
from planner.simulation.step import simulate

__all__ = ["agreed_plan", "check_tensor_parallel", "dtensor_parameters", "refuse_unannounced"]

_PLANNED_MODULES = (nn.Linear, nn.Embedding)
"""Modules whose DTensor parameters ColwiseParallel and RowwiseParallel make (style.py `_apply`)."""

_INSTEAD = (
    "plan the Megatron pattern: ColwiseParallel() on the attention's q/k/v and the MLP's gate/up "
    "projections, RowwiseParallel() on their output projections, with their default Replicate() outputs "
    "and use_local_output=True, and norms left unparallelized"
)


def dtensor_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of every parameter of `model` that is a DTensor."""
    return [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]


def refuse_unannounced(model: nn.Module) -> None:
    """A model whose parameters are DTensors is planned only with `tensor_parallel=mesh`: without it each
    rank would solve alone and could choose another plan than the others (NOTE [tensor parallel plans])."""
    found = dtensor_parameters(model)
    if found:
        raise UnsupportedModel(
            f"{type(model).__name__}'s parameter {found[0][0]!r} is a DTensor (parallelize_module): pass "
            "tensor_parallel=<the tensor parallel DeviceMesh> on every rank, so that every rank gets the "
            "same plan (a plan that differs between ranks deadlocks the recomputed collectives)"
        )


def check_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Refuse what `tensor_parallel=mesh` does not plan (NOTE [tensor parallel plans]), naming what to
    do instead: a mesh that is not one-dimensional, a model with no DTensor parameter on it, and
    layouts other than column- and row-wise Linears handing on plain tensors."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "tensor_parallel must be the DeviceMesh the model was parallelized over, got "
            f"{type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        raise UnsupportedModel(
            f"tensor_parallel={mesh} has {mesh.ndim} dimensions; pass its tensor parallel dimension "
            "(world_mesh['tp']): FSDP or DDP on top of tensor parallelism is not planned yet"
        )
    found = dtensor_parameters(model)
    if not found:
        raise ValueError(
            f"no parameter of {type(model).__name__} is a DTensor: call parallelize_module(model, mesh, "
            "plan) first, then optimize inside each rank with tensor_parallel=mesh"
        )
    owners = dict(model.named_modules())
    for name, parameter in found:
        owner_name = name.rpartition(".")[0]
        owner = owners[owner_name]
        assert isinstance(parameter, DTensor)
        if parameter.device_mesh != mesh:
            raise UnsupportedModel(
                f"parameter {name!r} lives on {parameter.device_mesh}, not on tensor_parallel={mesh}: "
                "a model parallelized over several meshes (FSDP x TP) is not planned yet"
            )
        if not isinstance(owner, _PLANNED_MODULES):
            raise UnsupportedModel(
                f"{owner_name!r} ({type(owner).__name__}) holds the DTensor parameter {name!r}: that is "
                "SequenceParallel or another layout than ColwiseParallel/RowwiseParallel, not planned yet; "
                + _INSTEAD
            )
    for module_name, module in model.named_modules():
        if _keeps_dtensor_output(module):
            raise UnsupportedModel(
                f"{module_name or 'the model'!r} ({type(module).__name__}) hands on a DTensor "
                "(use_local_output=False, as SequenceParallel and loss parallelism need): not planned yet; "
                + _INSTEAD
                + ", and the loss computed on plain logits (output_layouts=Replicate())"
            )


def _keeps_dtensor_output(module: nn.Module) -> bool:
    """Whether one of `module`'s forward hooks is a parallel style's `_prepare_output_fn` with
    `use_local_output=False`. `distribute_module` registers a lambda that closes over
    `functools.partial(style._prepare_output_fn, ..., use_local_output)` (tensor/_api.py, style.py)."""
    for hook in module._forward_hooks.values():
        for cell in getattr(hook, "__closure__", None) or ():
            value = cell.cell_contents
            if (
                isinstance(value, functools.partial)
                and getattr(value.func, "__name__", "") == "_prepare_output_fn"
                and value.args
                and value.args[-1] is False
            ):
                return True
    return False


def _group_of(mesh: DeviceMesh) -> tuple[ProcessGroup, int, int]:
    """(process group, this rank's place in it, the global rank of its first member)."""
    group = mesh.get_group()
    return group, dist.get_rank(group), dist.get_global_rank(group, 0)


def agreed_plan(graph: ActivationGraph, solve: Callable[[], Plan], mesh: DeviceMesh) -> Plan:
    """The plan rank 0 of `mesh`'s group solves, on every rank, predicted on each rank's own `graph`.

    Rank 0 calls `solve()` and broadcasts the plan; the others take its schedule, budget and solver's
    figures over their own graph, so every rank checkpoints the same regions (NOTE [tensor parallel
    plans]). A rank whose graph lacks the schedule's nodes, or whose own predicted peak exceeds the
    budget, makes every rank raise. When rank 0 finds no plan, each other rank solves its own graph to
    raise its own error (`InfeasibleBudget` with its figures). Every rank of the group must call this.
    """
    group, place, source = _group_of(mesh)
    payload: list[object] = [None, ""]
    if place == 0:
        try:
            payload[0] = solve()
        except Exception as error:  # the others wait in the broadcast: tell them, then raise here
            payload[1] = f"{type(error).__name__}: {error}"
            dist.broadcast_object_list(payload, src=source, group=group)
            raise
    dist.broadcast_object_list(payload, src=source, group=group)
    solved, message = payload
    if not isinstance(solved, Plan):
        solve()
        raise PlannerError(f"rank 0 of the tensor parallel group found no plan, this rank did: {message}")
    verdict: int | str
    try:
        own = solved if place == 0 else _on_own_graph(solved, graph)
        verdict = simulate(own.graph, own.schedule).peak_bytes
    except UnsupportedModel as error:  # raised on every rank by the agreement, this one's included
        own, verdict = solved, str(error)
    _agree_on_every_rank(verdict, solved.budget_bytes, group)
    return own


def _on_own_graph(solved: Plan, graph: ActivationGraph) -> Plan:
    """Rank 0's plan with this rank's graph, which must have rank 0's nodes in rank 0's order (a
    schedule's regions are ranges of node positions)."""
    names = [node.name for node in graph.nodes]
    solved_names = [node.name for node in solved.graph.nodes]
    if names != solved_names:
        differ = next((pair for pair in zip(names, solved_names, strict=False) if pair[0] != pair[1]), None)
        raise UnsupportedModel(
            f"rank 0's plan is for another graph than this rank's ({len(solved_names)} nodes against "
            f"{len(names)}, first difference {differ}): the ranks captured different graphs, so one plan "
            "cannot serve them all"
        )
    return dataclasses.replace(solved, graph=graph)


def _agree_on_every_rank(verdict: int | str, budget_bytes: int, group: ProcessGroup) -> None:
    """Gather every rank's `verdict` on the plan (its own predicted peak, or why it cannot take the
    plan) and raise on every rank when one rank cannot take it or is predicted over the budget."""
    verdicts: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, verdict, group=group)
    for rank, other in enumerate(verdicts):
        if isinstance(other, str):
            raise UnsupportedModel(
                f"rank {rank} of the tensor parallel group cannot take rank 0's plan: {other}"
            )
        if isinstance(other, int) and other > budget_bytes:
            raise PlannerError(
                f"rank 0's plan is predicted at {other} B on rank {rank} of the tensor parallel group, over "
                f"the budget of {budget_bytes} B: the ranks hold different memory; plan with a lower budget"
            )
