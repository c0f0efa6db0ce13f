"""In-place ops of a captured graph run out of place, where nothing can observe the write.

Why it exists: a checkpointed region is replayed from its inputs, so an in-place write to one of them
breaks the replay. Both levels of the capture chain (chain.py) call `run_out_of_place` on the graph they
made; it is a rewrite of an fx graph on its own, with its own tables of the operators, modules and
functions whose output is a new tensor.

NOTE [in-place ops]: checkpointing keeps a region's input tensors to replay the region, and the replay
fails if one was written in place since (`out += identity` or `ReLU(inplace=True)` right after a region
boundary). Both levels therefore run an in-place op out of place when nothing can observe the write:
its tensor is new (made by a convolution, a norm, a Linear, an addition, an ATen op whose schema
returns no alias, ...) and no node after it reads that tensor; buffers are never switched. Values are
the same; the tensor written is a new one. In-place ops that stay (writes through a view, slice
assignment, a tensor read again later) are found while profiling, by version counters, and
the profiler keeps their readers out of checkpointed regions.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["run_out_of_place"]


OUT_OF_PLACE_OPERATORS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}
"""Augmented assignments (`out += identity`) and the operators that compute them out of place."""

FRESH_MODULES = (
    nn.modules.conv._ConvNd,
    nn.Linear,
    nn.Bilinear,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.Embedding,
)
"""Modules whose output is always a new tensor, never a view of an input."""

FRESH_FUNCTIONS = frozenset(
    {
        *OUT_OF_PLACE_OPERATORS.values(),
        operator.matmul,
        torch.add,
        torch.cat,
        torch.matmul,
        torch.mul,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.gelu,
        F.layer_norm,
        F.linear,
    }
)
"""Functions whose output is always a new tensor."""


def _makes_fresh_tensor(node: fx.Node, graph_module: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return isinstance(graph_module.get_submodule(str(node.target)), FRESH_MODULES)
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        # ATen schemas annotate aliasing: an output without an alias annotation is a new tensor
        schema = node.target._schema
        return bool(schema.returns) and not schema.is_mutable and schema.returns[0].alias_info is None
    return node.target in FRESH_FUNCTIONS


def _only_reader(node: fx.Node, written: Any, order: dict[fx.Node, int]) -> bool:
    """True when no node after `node` reads `written`, so nothing can observe the in-place write."""
    return isinstance(written, fx.Node) and all(order[user] <= order[node] for user in written.users)


def _out_of_place_overload(operator_overload: Any) -> Any:
    """The out-of-place ATen overload of an in-place one (`aten.relu_.default` -> `aten.relu.default`)."""
    if not isinstance(operator_overload, torch._ops.OpOverload):
        return None
    schema = operator_overload._schema
    name = schema.name.removeprefix("aten::")
    if not name.endswith("_") or not schema.arguments or schema.arguments[0].alias_info is None:
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, operator_overload._overloadname, None) if packet is not None else None


def _out_of_place_form(node: fx.Node) -> Callable[[], None] | None:
    """A change that makes `node` compute out of place, or None when it is not an in-place op."""
    overload = _out_of_place_overload(node.target) if node.op == "call_function" else None
    if overload is not None:
        return lambda: setattr(node, "target", overload)
    if node.op == "call_function" and node.target in OUT_OF_PLACE_OPERATORS:
        replacement = OUT_OF_PLACE_OPERATORS[node.target]
        return lambda: setattr(node, "target", replacement)
    if node.op == "call_function" and node.kwargs.get("inplace") is True:
        return lambda: setattr(node, "kwargs", {**node.kwargs, "inplace": False})
    if node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("_"):
        method = str(node.target)[:-1]
        return (lambda: setattr(node, "target", method)) if hasattr(torch.Tensor, method) else None
    return None


def _in_place_module(node: fx.Node, graph_module: fx.GraphModule) -> bool:
    if node.op != "call_module":
        return False
    return getattr(graph_module.get_submodule(str(node.target)), "inplace", False) is True


def _graph_owns_parent(graph_module: fx.GraphModule, model: torch.nn.Module, target: str) -> bool:
    """True when the module holding `target` in the graph is the graph's own, not the model's."""
    parent_path = target.rpartition(".")[0]
    return not parent_path or graph_module.get_submodule(parent_path) is not model.get_submodule(parent_path)


def _out_of_place_plan(
    graph_module: fx.GraphModule, model: torch.nn.Module, excluded: set[str]
) -> tuple[list[Callable[[], None]], dict[str, bool]]:
    """The in-place calls to run out of place, and whether each in-place module's every call may be."""
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    fresh: set[fx.Node] = set()
    changes: list[Callable[[], None]] = []
    module_safe: dict[str, bool] = {}
    for node in graph_module.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or not node.args:
            continue
        written = node.args[0]
        safe = (
            isinstance(written, fx.Node)
            and (written in fresh or _makes_fresh_tensor(written, graph_module))
            and _only_reader(node, written, order)
        )
        if _in_place_module(node, graph_module):
            target = str(node.target)
            safe = safe and _graph_owns_parent(graph_module, model, target)
            module_safe[target] = module_safe.get(target, True) and safe
            if safe and target not in excluded:
                fresh.add(node)
            continue
        change = _out_of_place_form(node)
        if change is not None and safe:
            changes.append(change)
            fresh.add(node)
    return changes, module_safe


def run_out_of_place(graph_module: fx.GraphModule, model: torch.nn.Module) -> None:
    """Compute out of place the in-place ops whose writes nothing can observe; see NOTE [in-place ops].

    A module called at several places (one `self.relu` in a block) is switched only if every call
    may be; excluding one can make a later call unsafe, so the plan is redone until it is stable.
    """
    excluded: set[str] = set()
    while True:
        changes, module_safe = _out_of_place_plan(graph_module, model, excluded)
        unsafe = {target for target, safe in module_safe.items() if not safe}
        if unsafe <= excluded:
            break
        excluded |= unsafe
    for change in changes:
        change()
    for target in sorted(target for target in module_safe if target not in excluded):
        parent_path, _, name = target.rpartition(".")
        out_of_place = copy.copy(graph_module.get_submodule(target))
        object.__setattr__(out_of_place, "inplace", False)
        setattr(graph_module.get_submodule(parent_path), name, out_of_place)
    graph_module.recompile()
