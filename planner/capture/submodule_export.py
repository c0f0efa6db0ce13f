"""Containers that torch.fx cannot trace, captured by torch.export and inlined into the FX graph.

Why it exists: FX stops at Python control flow on tensor values, and `torch.nn`'s own containers are full
of it (`nn.TransformerEncoder` asks `src.is_nested`, `nn.MultiheadAttention` picks a fast path). Kept as
one opaque node, such a container can only be checkpointed whole, so a ViT holding an
`nn.TransformerEncoder` had no plan below "no checkpointing" while checkpointing each encoder layer by
hand halved its peak. torch.export (non-strict) runs the container's Python for the example call and
records the ATen operators it ran, with each operator's module path; inlined into the FX graph in place
of the opaque node, the container's layers become region boundaries like any block's.

NOTE [exported submodules]: a container is inlined only when it is called once, carries no hooks (export
would run them once, at capture), its call's inputs have the structure FX recorded, its outputs are one
tensor or a tuple indexed by constant positions, and the exported graph fetches the model's own
Parameters and buffers (gradients and tied weights stay the model's). Export specialises the container
to the example's shapes, so the planned module then checks every call's tensor shapes
(`GraphCall.pinned_shapes`). A container that export cannot capture either (data-dependent routing)
stays one opaque node: regions may contain it, not split it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.capture.kept_whole import drawing_generators_restored, refused_while_tracing, stored_during
from planner.errors import UnsupportedModel

__all__ = [
    "EXPORT_GUARDS_MODULE",
    "check_shared_state",
    "drop_export_guards",
    "inline_exported_containers",
    "quiet_export",
]

log = logging.getLogger(__name__)

EXPORT_GUARDS_MODULE = "_guards_fn"
"""The shape-guard call that `ExportedProgram.module()` inserts; `GraphCall` checks shapes instead."""


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """torch.export prints the partial graph to stderr when it fails; a fallback is no error, so log it."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            yield
    finally:
        if stderr.getvalue():
            log.debug("torch.export wrote to stderr:\n%s", stderr.getvalue())


def check_shared_state(graph_module: fx.GraphModule, model: torch.nn.Module) -> None:
    """The exported graph must fetch the model's own Parameters and buffers (gradients, tied weights)."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    foreign = [
        name
        for name, tensor in (*graph_module.named_parameters(), *graph_module.named_buffers())
        if id(tensor) not in own
    ]
    if foreign:
        raise UnsupportedModel(
            f"torch.export gave {type(model).__name__} copies of {foreign[:4]} instead of the model's own "
            "tensors; gradients would not reach the model."
        )


def drop_export_guards(graph_module: fx.GraphModule) -> None:
    for node in list(graph_module.graph.nodes):
        if node.op == "call_module" and node.target == EXPORT_GUARDS_MODULE and not node.users:
            graph_module.graph.erase_node(node)
    graph_module.recompile()


def _is_container(module: torch.nn.Module) -> bool:
    return any(True for _ in module.children())


@contextlib.contextmanager
def _state_preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run the model without changing its buffers (BatchNorm statistics) or the caller's random streams
    (torch's, Python's and NumPy's), with grad enabled as a training step runs it (a forward may take a
    gradient of its own)."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with torch.random.fork_rng(devices=[]), drawing_generators_restored(), torch.enable_grad():
        try:
            yield
        finally:
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _example_calls(
    model: torch.nn.Module, names: list[str], example: inspect.BoundArguments
) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """The (args, kwargs) of every call of each named submodule in one run of the example call."""
    calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {name: [] for name in names}
    handles = []
    for name in names:

        def record(_module: torch.nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            calls[name].append((tuple(args), dict(kwargs)))

        handles.append(model.get_submodule(name).register_forward_pre_hook(record, with_kwargs=True))
    try:
        with _state_preserved(model):
            model(*example.args, **example.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The unlifted exported graph of one container call, or None when export cannot capture it."""
    try:
        with (
            quiet_export(),
            _state_preserved(module),
            stored_during(module) as stored,
            refused_while_tracing(fake_tensors=True),
        ):
            exported = torch.export.export(module, args, kwargs, strict=False)
    except Exception as error:  # noqa: BLE001 - an untraceable container stays opaque
        log.info("torch.export cannot capture %s either (%s)", type(module).__name__, error)
        return None
    if stored.modules:
        log.info("not inlining %s: it stores tensors on %s", type(module).__name__, stored.modules)
        return None
    graph_module = exported.module()
    try:
        check_shared_state(graph_module, module)
    except Exception as error:  # noqa: BLE001 - copies of weights: keep the container opaque
        log.info("not inlining %s: %s", type(module).__name__, error)
        return None
    drop_export_guards(graph_module)
    return graph_module, exported.call_spec.out_spec


def _fetch(root: torch.nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _attribute(graph_module: fx.GraphModule, name: str, target: str, value: Any) -> str:
    """The parent graph's attribute path for the container's `target`: the same object when the
    parent reaches it as `name.target` (a Parameter, a buffer), else a new attribute (a constant)."""
    path = f"{name}.{target}"
    try:
        if _fetch(graph_module, path) is value:
            return path
    except AttributeError:
        pass
    constant = f"_exported_{name}_{target}".replace(".", "_")
    setattr(graph_module, constant, value)
    return constant


def _relabelled(meta: dict[str, Any], name: str, outer: dict[str, Any]) -> dict[str, Any]:
    """The node's meta with its module stack put under the container's own."""
    meta = copy.copy(meta)
    stack = dict(outer)
    stack[name] = (name, stack.get(name, (name, None))[1])
    for key, (path, module_type) in (meta.get("nn_module_stack") or {}).items():
        stack[f"{name}.{key}"] = (f"{name}.{path}" if path else name, module_type)
    meta["nn_module_stack"] = stack
    return meta


def _output_users(node: fx.Node, outputs: Any) -> dict[fx.Node, fx.Node] | None:
    """How each user of the opaque node maps onto the inlined outputs; None if one cannot be mapped."""
    if isinstance(outputs, fx.Node):
        return {user: outputs for user in node.users}
    if not isinstance(outputs, tuple | list) or not all(isinstance(out, fx.Node) for out in outputs):
        return None
    mapping: dict[fx.Node, fx.Node] = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        mapping[user] = outputs[user.args[1]]
    return mapping


def _inline(graph_module: fx.GraphModule, node: fx.Node, name: str, exported: Any, out_spec: Any) -> bool:
    """Replace `node` by the exported graph; False (and nothing changed) when it cannot be."""
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    leaves, _ = tree_flatten((node.args, node.kwargs))
    if len(placeholders) != len(leaves):
        return False
    graph = graph_module.graph
    environment: dict[fx.Node, Any] = dict(zip(placeholders, leaves, strict=True))
    outer = node.meta.get("nn_module_stack") or {}
    added: list[fx.Node] = []
    flat_outputs: Any = None
    with graph.inserting_before(node):
        for inner in exported.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                flat_outputs = fx.node.map_arg(inner.args[0], environment.__getitem__)
                continue
            if inner.op == "get_attr":
                value = _fetch(exported, str(inner.target))
                copied = graph.get_attr(_attribute(graph_module, name, str(inner.target), value))
            else:
                copied = graph.node_copy(inner, environment.__getitem__)
            copied.meta = _relabelled(inner.meta, name, outer)
            environment[inner] = copied
            added.append(copied)
    outputs = tree_unflatten(list(flat_outputs), out_spec)
    users = _output_users(node, outputs)
    if users is None:
        for copied in reversed(added):
            graph.erase_node(copied)
        return False
    for user, replacement in users.items():
        if user.target is operator.getitem and replacement is not outputs:
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
        else:
            user.replace_input_with(node, replacement)
    graph.erase_node(node)
    return True


def inline_exported_containers(
    graph_module: fx.GraphModule, model: torch.nn.Module, opaque: set[str], example: inspect.BoundArguments
) -> list[str]:
    """Inline each opaque container of `graph_module` that torch.export captures (see the NOTE);
    returns the names inlined. The graph is recompiled when any was."""
    containers = sorted(name for name in opaque if _is_container(model.get_submodule(name)))
    if not containers:
        return []
    calls = _example_calls(model, containers, example)
    inlined = []
    for name in containers:
        nodes = [n for n in graph_module.graph.nodes if n.op == "call_module" and n.target == name]
        if len(calls[name]) != 1 or len(nodes) != 1:
            continue
        args, kwargs = calls[name][0]
        captured = _export(model.get_submodule(name), args, kwargs)
        if captured is not None and _inline(graph_module, nodes[0], name, *captured):
            inlined.append(name)
    if inlined:
        graph_module.graph.lint()
        graph_module.recompile()
        log.info("inlined %s captured by torch.export", inlined)
    return inlined
