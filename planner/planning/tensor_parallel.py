"""Plans for a model that `parallelize_module` already split across ranks (tensor parallelism).

Why it exists: a tensor parallel model runs collectives inside its forward (the all-reduce after each
row-wise Linear) and, under a checkpoint, again inside its backward when a region is recomputed. Every
rank of the tensor parallel group must therefore run the same regions in the same order, or one rank
waits in a collective the others never start. Each rank profiles its own step (its own shards, measured
where it runs, NOTE [tensor parallel plans]), so measured node times differ between ranks and a solver
could choose differently on each; here the ranks' graphs are merged (each node's largest workspace),
rank 0 solves the merged graph and broadcasts the plan, and every rank takes it. This module also
refuses the tensor parallel layouts that are not planned yet, naming what to do instead.

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
- A collective's result may outlive its last use: the process group's work object holds it too and
  drops it on the backend's own thread when the work completes (measured: of the all-reduces of five
  steps of a 4-block stack on 2 gloo ranks, 5 results were freed off the main thread on rank 0, none on
  rank 1; ProcessGroupNCCL's watchdog releases what a work stashed the same way). So a step's peak may
  hold one more all-reduced activation than the order of its operators says, in some runs on some
  ranks: a plan at its predicted peak measured 11,351,040 B against 11,219,968 predicted, once in four
  runs. The profiles saw it in backward only (in a node's backward or replay workspace), so the plan
  is made for it there: every node's backward and replay workspace gets one such buffer
  (`with_collective_buffer`, the largest collective result of a backward, `collective_buffer_bytes`),
  and the ranks' graphs, which differ by it, are merged at each node's largest workspace
  (`merged_graph`).
- Not planned yet, and refused: `SequenceParallel` (it replicates norm weights as DTensors and hands
  DTensors between modules, `use_local_output=False`), any module's output left a DTensor
  (`use_local_output=False`, which loss parallelism needs for the logits), DTensor parameters of other
  modules than Linear and Embedding, and parameters on a mesh of more than one dimension (FSDP x TP).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from planner.errors import PlannerError, UnsupportedModel
from planner.ir import ActivationGraph, Node
from planner.planning.plan import Plan
from planner.profiler.counting import counted_bytes, local_tensors, tensors_in
from planner.profiler.interpreter import preserved_state

__all__ = [
    "agreed_plan",
    "check_tensor_parallel",
    "collective_buffer_bytes",
    "dtensor_parameters",
    "merged_graph",
    "with_collective_buffer",
]

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


def _refuse_unannounced(model: nn.Module) -> None:
    """A model whose parameters are DTensors is planned only with `tensor_parallel=mesh`: without it each
    rank would solve alone and could choose another plan than the others (NOTE [tensor parallel plans])."""
    found = dtensor_parameters(model)
    if found:
        raise UnsupportedModel(
            f"{type(model).__name__}'s parameter {found[0][0]!r} is a DTensor (parallelize_module): pass "
            "tensor_parallel=<the tensor parallel DeviceMesh> on every rank, so that every rank gets the "
            "same plan (a plan that differs between ranks deadlocks the recomputed collectives)"
        )


def check_tensor_parallel(model: nn.Module, mesh: DeviceMesh | None, world_size: int) -> None:
    """Refuse what `tensor_parallel=mesh` does not plan (NOTE [tensor parallel plans]), naming what to
    do instead: a DTensor model without a mesh, a mesh that is not one-dimensional, a model with no
    DTensor parameter on it, layouts other than column- and row-wise Linears handing on plain tensors,
    and data parallelism (`world_size`) on top."""
    if mesh is None:
        _refuse_unannounced(model)
        return
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
    if world_size != 1:
        raise UnsupportedModel(
            f"tensor_parallel with world_size={world_size}: data parallelism on top of tensor "
            "parallelism is not planned yet; plan one tensor parallel group (world_size=1)"
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


def agreed_plan(
    graph: ActivationGraph, solve: Callable[[ActivationGraph], Plan], mesh: DeviceMesh, *, buffer_bytes: int
) -> Plan:
    """One plan for every rank of `mesh`'s group: `solve` on the ranks' graphs merged, run by rank 0
    and broadcast.

    Every rank's `graph` is gathered and merged (`merged_graph`: each node's workspace the largest any
    rank measured, rank 0's times), with a collective's `buffer_bytes` more workspace at every node
    (`with_collective_buffer`); rank 0 solves that graph and every rank takes that plan, so
    every rank checkpoints the same regions and predicts the same peak, its own ranks' highest (NOTE
    [tensor parallel plans]). When rank 0 finds no plan, each other rank solves the merged graph to
    raise the same error (`InfeasibleBudget`). Every rank of the group must call this.
    """
    group, place, source = _group_of(mesh)
    graphs: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(graphs, graph, group=group)
    merged = merged_graph([g for g in graphs if isinstance(g, ActivationGraph)])
    merged = with_collective_buffer(merged, buffer_bytes)
    payload: list[object] = [None, ""]
    if place == 0:
        try:
            payload[0] = solve(merged)
        except Exception as error:  # the others wait in the broadcast: tell them, then raise here
            payload[1] = f"{type(error).__name__}: {error}"
            dist.broadcast_object_list(payload, src=source, group=group)
            raise
    dist.broadcast_object_list(payload, src=source, group=group)
    solved, message = payload
    if not isinstance(solved, Plan):
        solve(merged)
        raise PlannerError(f"rank 0 of the tensor parallel group found no plan, this rank did: {message}")
    return solved


class _CollectiveResults(TorchDispatchMode):
    """Records the largest result of a `_c10d_functional` collective (its local storage, counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            for tensor in tensors_in(output):
                for local in local_tensors(tensor):
                    self.largest_bytes = max(
                        self.largest_bytes, counted_bytes(local.untyped_storage().nbytes())
                    )
        return output


def collective_buffer_bytes(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], loss_fn: Callable[[Any], torch.Tensor]
) -> int:
    """The largest result of a collective in the backward of one step of `model` (the all-reduced input
    gradients of column-wise Linears): the buffer a collective may hold past its last use where the
    profiles and measurements saw one (NOTE [tensor parallel plans]). Runs a forward and backward with
    their collectives, so every rank must call it; the model's state, its gradients and the RNG are
    left as they were."""
    probe = _CollectiveResults()
    trainable = [p for p in model.parameters() if p.requires_grad]
    with preserved_state(model):
        loss = loss_fn(model(*args, **kwargs))
        with probe:
            torch.autograd.grad(loss, trainable, allow_unused=True)
    return probe.largest_bytes


def with_collective_buffer(graph: ActivationGraph, buffer_bytes: int) -> ActivationGraph:
    """`graph` with `buffer_bytes` more workspace at every node's backward and replay: a collective's
    result its work object may not yet have dropped (NOTE [tensor parallel plans])."""
    nodes = tuple(
        dataclasses.replace(
            node,
            backward_workspace_bytes=node.backward_workspace_bytes + buffer_bytes,
            backward_points=tuple((bytes_ + buffer_bytes, freed) for bytes_, freed in node.backward_points),
            replay_workspace_bytes=None
            if node.replay_workspace_bytes is None
            else node.replay_workspace_bytes + buffer_bytes,
        )
        for node in graph.nodes
    )
    return dataclasses.replace(graph, nodes=nodes)


def merged_graph(graphs: Sequence[ActivationGraph]) -> ActivationGraph:
    """The first graph, with each node's workspaces and the static bytes the largest of any graph's.

    The ranks' graphs of one tensor parallel step hold the same nodes and storages, but a buffer an
    all-reduce hands back lives a little longer or shorter as the collective's thread runs: in 3 of 14
    profiles of a 4-block stack on 2 ranks, one node's backward workspace differed between the ranks by
    one all-reduced activation (131,072 B). A plan made for the largest fits every rank.
    """
    first = graphs[0]
    for other in graphs[1:]:
        if [n.name for n in other.nodes] != [n.name for n in first.nodes] or any(
            (a.creates, a.reads, a.saves) != (b.creates, b.reads, b.saves)
            for a, b in zip(first.nodes, other.nodes, strict=True)
        ):
            raise UnsupportedModel(
                "the ranks of the tensor parallel group captured different graphs (other nodes or storages), "
                "so one plan cannot serve them all; give every rank the same model and example shapes"
            )
    nodes = tuple(_largest([g.nodes[index] for g in graphs]) for index in range(len(first.nodes)))
    static = dataclasses.replace(
        first.static,
        **{
            field.name: max(getattr(g.static, field.name) for g in graphs)
            for field in dataclasses.fields(first.static)
            if isinstance(getattr(first.static, field.name), int)
        },
    )
    storage_bytes = {name: max(g.storage_bytes.get(name, 0) for g in graphs) for name in first.storage_bytes}
    return dataclasses.replace(first, nodes=nodes, static=static, storage_bytes=storage_bytes)


def _largest(versions: list[Node]) -> Node:
    """One node as every rank profiled it, with the largest workspaces any rank measured."""
    node = max(versions, key=lambda n: (n.backward_workspace_bytes, n.forward_workspace_bytes))
    stops = [n.replay_stop_bytes for n in versions]
    replays = [n.replay_workspace_bytes for n in versions]
    return dataclasses.replace(
        node,
        forward_ms=versions[0].forward_ms,
        backward_ms=versions[0].backward_ms,
        forward_workspace_bytes=max(n.forward_workspace_bytes for n in versions),
        backward_workspace_bytes=max(n.backward_workspace_bytes for n in versions),
        replay_workspace_bytes=None if None in replays else max(r for r in replays if r is not None),
        replay_stop_bytes=None if None in stops else max(s for s in stops if s is not None),
        parameter_gradient_bytes=max(n.parameter_gradient_bytes for n in versions),
        keep_cache_bytes=max(n.keep_cache_bytes for n in versions),
    )
