"""Scalar constants that export lifts into the graph, given back to the operators as Python numbers or
made at each call, as the model made them.

Why it exists: the captured module must cost no more than the model it came from (issue 35), and an
exported graph can hold a constant the model never keeps. `scalars_given_back` is a rewrite of an fx
graph on its own, run by both levels of the capture chain (chain.py): the FX level's graph inlines
exported containers.

NOTE [lifted scalars]: an assignment of a Python number into a tensor (`shifted[..., 0] = start_id` in
Hugging Face T5's `_shift_right`) runs in eager as `fill_` with a Scalar and allocates nothing, but
torch.export records the number as a 0-dim tensor constant of the graph module, copied by
`lift_fresh_copy` into each call's `fill_.Tensor`. The constant lived as long as the captured module
(one 512-byte block on a GPU, which a measurement of the module on the CPU never saw, as it is no
parameter or buffer) and its copy was one more allocation per step: zoo_real's T5 was predicted 512 B
above its measured step, with checkpointing and without. So a copy of a 0-dim constant that only feeds
operators with a Scalar overload of the same arguments goes: each reader takes the overload and the
number, as eager ran it, where the result's dtype is the same either way. Any other copy is made from
the number at each call (`aten.full` with the constant's dtype and device), as eager's
`torch.tensor(number)` made it, and the constant goes too: DeBERTa-v2's attention scales (`torch.tensor`
of a size, then `sqrt`, a tensor divisor) left six such constants, predicted as resident and seen by no
measurement, so its plans were predicted up to 3,072 B above their measured steps. A one-element
constant of one or more dimensions (`torch.tensor([n])`: Falcon's attention lifted four, and its plans
were predicted 2,048 B above their steps) is made at each call the same way, with its shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["scalars_given_back"]

LIFT_FRESH_COPY = torch.ops.aten.lift_fresh_copy.default
"""What export puts between a lifted constant and the operator reading it."""


def scalars_given_back(graph_module: fx.GraphModule) -> int:
    """Give 0-dim constants back to their readers as numbers, or make one-element constants at each call
    (NOTE [lifted scalars]); returns how many constants went."""
    graph = graph_module.graph
    given_back = 0
    for copy in list(graph.find_nodes(op="call_function", target=LIFT_FRESH_COPY)):
        source = copy.args[0]
        if not isinstance(source, fx.Node) or source.op != "get_attr":
            continue
        constant = _attribute(graph_module, str(source.target))
        if not isinstance(constant, torch.Tensor) or constant.numel() != 1 or constant.is_meta:
            continue
        number = constant.item()
        overloads = {reader: _scalar_overload(reader, copy, number) for reader in copy.users}
        if not overloads:
            continue
        if constant.dim() != 0 or any(overload is None for overload in overloads.values()):
            _made_per_call(graph, copy, constant, number)
        else:
            for reader, overload in overloads.items():
                reader.target = overload
                reader.args = tuple(number if argument is copy else argument for argument in reader.args)
            graph.erase_node(copy)
        if not source.users:
            graph.erase_node(source)
            owner, _, name = str(source.target).rpartition(".")
            delattr(_attribute(graph_module, owner) if owner else graph_module, name)
        given_back += 1
    if given_back:
        graph_module.recompile()
    return given_back


def _made_per_call(graph: fx.Graph, copy: fx.Node, constant: torch.Tensor, number: Any) -> None:
    """Replace `copy` of the one-element `constant` by a tensor made from `number` at each call (NOTE
    [lifted scalars]): the same shape, value, dtype and device, and no constant held between calls."""
    shape = list(constant.shape)
    with graph.inserting_before(copy):
        fresh = graph.call_function(
            torch.ops.aten.full.default, (shape, number), {"dtype": constant.dtype, "device": constant.device}
        )
    fresh.meta = dict(copy.meta)
    copy.replace_all_uses_with(fresh)
    graph.erase_node(copy)


def _attribute(graph_module: fx.GraphModule, target: str) -> Any:
    value: Any = graph_module
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _scalar_overload(reader: fx.Node, copy: fx.Node, number: Any) -> Any:
    """The Scalar overload `reader` can take with `number` in place of `copy`, or None."""
    target = reader.target
    if not isinstance(target, torch._ops.OpOverload) or copy in reader.kwargs.values():
        return None
    scalar = getattr(target.overloadpacket, "Scalar", None)
    if scalar is None or target._overloadname != "Tensor":
        return None
    tensor_arguments = target._schema.arguments
    scalar_arguments = scalar._schema.arguments
    if [a.name for a in tensor_arguments] != [a.name for a in scalar_arguments]:
        return None
    for position, argument in enumerate(reader.args):
        takes = scalar_arguments[position].type
        if argument is copy and not isinstance(takes, torch.NumberType):
            return None
        if argument is not copy and str(takes) != str(tensor_arguments[position].type):
            return None
    return scalar if _same_result_dtype(reader, copy, number) else None


def _same_result_dtype(reader: fx.Node, copy: fx.Node, number: Any) -> bool:
    """Whether the other tensor arguments promote with `number` as with the 0-dim constant."""
    constant = copy.meta.get("val")
    values = [a.meta.get("val") for a in reader.args if isinstance(a, fx.Node) and a is not copy]
    others = [value for value in values if isinstance(value, torch.Tensor)]
    if not isinstance(constant, torch.Tensor) or not others or len(others) != len(values):
        return False
    return all(torch.result_type(o, constant) == torch.result_type(o, number) for o in others)
