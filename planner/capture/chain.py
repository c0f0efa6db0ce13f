"""Turns a model and an example call into a torch.fx GraphModule that the planner can profile and rewrite.

Users bring the models they train, and no single capture works on all of them, so capture is a chain
that takes the finest level that works and records which one it took (`Capture.path`, shown in
`Plan.capture`):

1. `"fx"`: `torch.fx` symbolic tracing. Nodes are Python-level calls (a Linear, a `relu`, an `add`), the
   graph is shape-generic, and non-tensor arguments of the example call (`None`, flags, numbers) are
   specialised (`concrete_args`, checked by asserts in the graph). FX fails on Python control flow that
   depends on tensor values; the innermost submodule whose `forward` raised is then kept as one opaque
   node and tracing goes on (`"fx (opaque: block.3)"`; the planner checkpoints it whole or not at all).
2. `"export"`: `torch.export.export(strict=False)`, when FX fails in the root's own forward. It traces
   through what FX cannot (Hugging Face models' keyword inputs, `ModelOutput` dataclasses, decorators,
   `*args`/`**kwargs`) down to ATen operators, keeping in-place ops and buffer updates as they run in
   training. The unlifted graph fetches the model's own Parameter and buffer objects, so gradients and
   tied weights are the model's. The batch and sequence dimensions of every tensor input (the first
   two) are exported as `Dim.AUTO`: export keeps dynamic what the model lets vary and specialises the
   rest, recording ranges and guards (see NOTE [other shapes]); when that fails, the graph is
   specialised to the example's shapes. It is specialised to the example call's structure either way.
3. When neither works, `capture` raises `UnsupportedModel` naming the construct each level failed on
   and the workaround; `optimize` then plans the model by its submodules, running its forward as
   written (`"module"`, planner/capture/model_call.py), and raises only if that finds none to checkpoint.

NOTE [hooks]: hooks must behave as without checkpointing. The planned module shares the root's hook
dictionaries, so the root's hooks run once per call; both levels trace the root's `forward`, not its
`__call__`, so the hooks are not also traced into the graph. FX keeps a submodule with hooks as one
node that calls the module (its hooks run), and the profiler marks that node not checkpointable, so a
replay never runs the hooks a second time. torch.export would inline such a submodule and run its hooks
once, at capture, so the export level refuses models whose submodules carry hooks.

NOTE [in-place ops]: checkpointing keeps a region's input tensors to replay the region, and the replay
fails if one was written in place since (`out += identity` or `ReLU(inplace=True)` right after a region
boundary). Both levels therefore run an in-place op out of place when nothing can observe the write:
its tensor is new (made by a convolution, a norm, a Linear, an addition, an ATen op whose schema
returns no alias, ...) and no node after it reads that tensor; buffers are never switched. Values are
the same; the tensor written is a new one. In-place ops that stay (writes through a view, slice
assignment, a tensor read again later) are found while profiling, by version counters, and
the profiler keeps their readers out of checkpointed regions.

Which inputs the graph takes is the job of `GraphCall`: the planned module is called like the model
(`model(x, attention_mask=m)`), and the captured graph takes either the bound arguments in signature
order (FX) or the flat tensors of the example call's structure (export).

NOTE [other shapes]: `GraphCall.admits` says whether a call can run on the captured graph. An FX graph
runs at any shape unless it inlines a container that torch.export specialised (`pinned_shapes`). An
exported graph needs the example's structure, dtypes, devices and contiguity (export asserts dtypes
and traces views for the example's strides), and either the example's shapes (a static export) or
shapes inside the ranges and guards of its dynamic dimensions, checked as torch.export checks the
inputs of the modules it unlifts (which admits sizes 0 and 1 where the range starts at 2: export
reasons as if a dynamic size were at least 2, and the graph it records holds for 1 as well). A call
the graph does not admit is captured again at its own shape (planner/rewrite/other_shapes.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import operator
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._export.utils import _check_input_constraints_for_graph
from torch.export import Dim
from torch.utils._pytree import TreeSpec, tree_flatten, tree_flatten_with_path, tree_map

from planner.capture.submodule_export import (
    EXPORT_GUARDS_MODULE,
    check_shared_state,
    drop_export_guards,
    inline_exported_containers,
    quiet_export,
)
from planner.errors import UnsupportedModel

__all__ = [
    "Capture",
    "CapturePath",
    "ExportedShapes",
    "GraphCall",
    "call_shapes",
    "candidate_units",
    "capture",
    "has_hooks",
    "hooked_submodules",
]

log = logging.getLogger(__name__)

MAX_OPAQUE_MODULES = 64
"""A model with more untraceable submodules than this is better served by the export level."""


class CapturePath(StrEnum):
    """The levels of the capture chain, finest first (the values `Capture.path` and `Plan.capture`
    start with); members are their string values."""

    FX = "fx"
    EXPORT = "export"
    MODULE = "module"
    """The model's own submodules as whole units (planner/capture/model_call.py)."""


def _shapes(values: Any) -> tuple[tuple[int, ...] | None, ...]:
    leaves, _ = tree_flatten(values)
    return tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves)


def call_shapes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...] | None, ...]:
    """The tensor shapes of a call, leaf by leaf (None for a leaf that is not a tensor)."""
    return _shapes((tuple(args), dict(kwargs)))


TensorLayout = tuple[torch.dtype, str, bool]
"""A tensor's dtype, device type and whether it is contiguous: what an export specialises besides
shapes (it asserts dtypes, places new tensors on the example's device, traces views for its strides)."""


def _layouts(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[TensorLayout | None, ...]:
    """The layout of each tensor of a call (None for a leaf that is not a tensor)."""
    leaves, _ = tree_flatten((tuple(args), dict(kwargs)))
    return tuple(
        (leaf.dtype, leaf.device.type, leaf.is_contiguous()) if isinstance(leaf, torch.Tensor) else None
        for leaf in leaves
    )


@dataclass(frozen=True)
class ExportedShapes:
    """What a graph exported with dynamic dimensions accepts: its input placeholders (whose values
    carry symbolic shapes), each symbol's range, and export's guards relating them."""

    placeholders: tuple[fx.Node, ...]
    range_constraints: Mapping[Any, Any]
    guards: Callable[..., Any] | None

    def __deepcopy__(self, memo: dict[int, Any]) -> ExportedShapes:
        """Shared, not copied: it describes shapes and holds no model state (its placeholders' values
        are fake tensors, which cannot be copied), so a copy of a planned module uses it as it is."""
        return self

    def admit(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        leaves_with_path, _ = tree_flatten_with_path((tuple(args), dict(kwargs)))
        try:
            # export's own check of an unlifted module's inputs against its symbols' ranges
            _check_input_constraints_for_graph(
                list(self.placeholders), leaves_with_path, self.range_constraints
            )
            if self.guards is not None:
                self.guards(*(leaf for _, leaf in leaves_with_path))
        except (AssertionError, RuntimeError) as violated:
            log.debug("outside the exported graph's shapes: %s", violated)
            return False
        return True


@dataclass(frozen=True)
class GraphCall:
    """Maps a call of the model, `model(*args, **kwargs)`, onto the captured graph's inputs.

    With `example_spec` None (FX), the graph takes the bound arguments in signature order, defaults
    filled in, so every call that binds to the forward's signature works. Otherwise (export) the graph
    takes the flat leaves of `(args, kwargs)`, and a call must have the example's structure. Which
    shapes a graph admits: see NOTE [other shapes].
    """

    signature: inspect.Signature
    example_spec: TreeSpec | None = None
    example_shapes: tuple[tuple[int, ...] | None, ...] = ()
    example_layouts: tuple[TensorLayout | None, ...] = ()
    """The example's tensors' dtypes, devices and contiguity, which an export specialises."""
    exported_shapes: ExportedShapes | None = None
    """The ranges and guards of an export with dynamic dimensions; None: the example's shapes only."""
    pinned_shapes: tuple[tuple[int, ...] | None, ...] | None = None
    """FX graphs with an exported submodule inlined (NOTE [exported submodules]) run only at the
    example's tensor shapes: the bound arguments' shapes."""

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphCall:
        """Shared, not copied: a description of calls that holds no model state."""
        return self

    def admits(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """True when the captured graph can run this call (see NOTE [other shapes])."""
        if self.example_spec is None:
            return self.pinned_shapes is None or _shapes(self._bound(args, kwargs)) == self.pinned_shapes
        args, kwargs = tuple(args), self._ordered(kwargs)
        _, spec = tree_flatten((args, kwargs))
        if spec != self.example_spec or _layouts(args, kwargs) != self.example_layouts:
            return False
        if self.exported_shapes is None:
            return call_shapes(args, kwargs) == self.example_shapes
        return self.exported_shapes.admit(args, kwargs)

    def graph_arguments(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The (args, kwargs) to call the captured GraphModule with, for a call it `admits`."""
        if self.example_spec is None:
            return self._bound(args, kwargs), {}
        return tuple(args), dict(kwargs)

    def graph_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """The placeholder values of the captured graph (what an fx.Interpreter over it takes)."""
        if self.example_spec is None:
            return self._bound(args, kwargs)
        leaves, _ = tree_flatten((tuple(args), self._ordered(kwargs)))
        return tuple(leaves)

    def _bound(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _ordered(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments in the forward's parameter order, as the example's structure lists them
        (a data collator may order a batch's keys otherwise)."""
        order = {name: index for index, name in enumerate(self.signature.parameters)}
        return dict(sorted(kwargs.items(), key=lambda item: order.get(item[0], len(order))))


@dataclass(frozen=True)
class Capture:
    """A traced model, the path that produced it, and how its example call maps onto the graph."""

    graph_module: fx.GraphModule
    path: str
    opaque_modules: tuple[str, ...]
    call: GraphCall
    inputs: tuple[Any, ...] = ()
    """The example call as the graph takes it (`GraphCall.graph_inputs` of the example)."""
    exported_modules: tuple[str, ...] = ()
    """Containers FX could not trace that torch.export captured and the graph inlines."""

    def label(self, split: Collection[str] = ()) -> str:
        """`path`, saying which opaque modules (or modules kept whole for their hooks) a profile
        split at their children's calls (NOTE [split calls] in simulation/step.py)."""
        if not self.path.startswith(CapturePath.FX):
            return self.path
        opaque = [name for name in self.opaque_modules if name not in split]
        return _fx_path(opaque, list(self.exported_modules), sorted(split))


HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
"""Where `nn.Module` keeps the hooks registered on one module instance."""


def has_hooks(module: torch.nn.Module) -> bool:
    """True when hooks are registered on this module instance (global hooks are not counted)."""
    return any(getattr(module, name, None) for name in HOOK_DICTS)


def hooked_submodules(model: torch.nn.Module) -> list[str]:
    """Qualified names of the model's submodules (not the root) that carry hooks."""
    return [name for name, module in model.named_modules() if name and has_hooks(module)]


class _OpaqueTracer(fx.Tracer):
    """The default tracer, but the named submodules stay single call_module nodes, and `torch.nn`'s own
    containers (an `nn.TransformerEncoder`, an `nn.MultiheadAttention`) are traced into, not kept as
    leaves: their layers are blocks to plan (if tracing fails inside, the container becomes opaque and
    torch.export may capture it; see planner/capture/submodule_export.py).

    Submodules with hooks stay single nodes too (see NOTE [hooks]): called as modules, their hooks run.
    """

    def __init__(self, opaque: set[str]) -> None:
        super().__init__()
        self.opaque = opaque

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return (
            qualified_name in self.opaque
            or has_hooks(module)
            or (super().is_leaf_module(module, qualified_name) and not any(True for _ in module.children()))
        )


DOMINANT_SHARE = 0.5
"""A unit with more than this share of the parameters is split into its children."""
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _parameter_count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def candidate_units(model: nn.Module) -> list[str]:
    """Qualified names of the submodules of `model` that a plan by submodules may checkpoint one by one:
    its children, with containers (ModuleList/ModuleDict/Sequential) replaced by their children, and a
    child holding most of the parameters replaced by its children too (a decoder by its blocks)."""
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


def _failing_module(model: torch.nn.Module, error: BaseException) -> str | None:
    """Qualified name of the innermost module whose forward is on the traceback of `error`."""
    names = {id(module): name for name, module in model.named_modules()}
    innermost: str | None = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and owner is not None and id(owner) in names:
            innermost = names[id(owner)]
    return innermost


def _describe(error: BaseException) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}"


def _concrete_arguments(signature: inspect.Signature, example: inspect.BoundArguments) -> dict[str, Any]:
    """Arguments FX should specialise: every non-tensor value of the example call, defaults included."""
    example = inspect.BoundArguments(example.signature, example.arguments.copy())
    example.apply_defaults()
    return {
        name: value
        for name, value in example.arguments.items()
        if not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0])
        and signature.parameters[name].kind
        not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }


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


def _run_out_of_place(graph_module: fx.GraphModule, model: torch.nn.Module) -> None:
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


def _capture_fx(
    model: torch.nn.Module, signature: inspect.Signature, example: inspect.BoundArguments | None
) -> Capture:
    """Trace with FX, keeping untraceable submodules opaque; raise UnsupportedModel if the root fails."""
    variadic = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if variadic:
        raise UnsupportedModel(
            f"torch.fx cannot bind the forward of {type(model).__name__}: it takes variadic parameters "
            f"{variadic}."
        )
    concrete = _concrete_arguments(signature, example) if example is not None else None
    opaque: set[str] = set()
    while True:
        tracer = _OpaqueTracer(opaque)
        try:
            graph = tracer.trace(model, concrete_args=concrete)
        except Exception as error:  # noqa: BLE001 - any tracing failure is a reason to try a coarser level
            failing = _failing_module(model, error)
            if failing is None or failing == "" or failing in opaque or len(opaque) >= MAX_OPAQUE_MODULES:
                where = f"submodule {failing!r}" if failing else f"the forward of {type(model).__name__}"
                raise UnsupportedModel(
                    f"torch.fx cannot trace {where}: {_describe(error)} (FX follows tensor operations and "
                    "module calls, not control flow on tensor values or item assignment: move such code "
                    "into a submodule, which FX keeps as one opaque node, or branch with torch.where)"
                ) from error
            log.info("fx could not trace %s (%s); keeping it opaque", failing, type(error).__name__)
            opaque.add(failing)
            continue
        graph_module = fx.GraphModule(tracer.root, graph, type(model).__name__)
        exported = inline_exported_containers(graph_module, model, opaque, example) if example else []
        _run_out_of_place(graph_module, model)
        call = GraphCall(signature=signature)
        inputs = call.graph_inputs(example.args, example.kwargs) if example is not None else ()
        if exported:
            call = dataclasses.replace(call, pinned_shapes=_shapes(inputs))
        still_opaque = sorted(opaque - set(exported))
        return Capture(
            graph_module=graph_module,
            path=_fx_path(still_opaque, exported),
            opaque_modules=tuple(still_opaque),
            call=call,
            inputs=inputs,
            exported_modules=tuple(exported),
        )


def _fx_path(opaque: list[str], exported: list[str], split: list[str] | None = None) -> str:
    """`Capture.path` of an FX capture: which submodules torch.export captured, which ones a profile
    split at their children's calls, which stayed opaque."""
    notes = []
    if exported:
        notes.append(f"exported: {', '.join(exported)}")
    if split:
        notes.append(f"planned by children: {', '.join(split)}")
    if opaque:
        notes.append(f"opaque: {', '.join(opaque)}")
    return f"{CapturePath.FX.value} ({'; '.join(notes)})" if notes else CapturePath.FX.value


@contextlib.contextmanager
def _root_hooks_suspended(model: torch.nn.Module) -> Iterator[None]:
    """Export the root's forward without its hooks, which the planned module runs itself."""
    saved = {name: getattr(model, name) for name in HOOK_DICTS}
    try:
        for name, hooks in saved.items():
            setattr(model, name, type(hooks)())
        yield
    finally:
        for name, hooks in saved.items():
            setattr(model, name, hooks)


DYNAMIC_DIMENSIONS = 2
"""The leading dimensions of each tensor input exported as `Dim.AUTO`: batch and sequence (either order).
The rest (features, channels, image sizes) stay the example's: each dynamic dimension costs export
symbolic reasoning (a dynamic export of a small GPT-2 takes about three times a static one)."""


def _dynamic_shapes(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`Dim.AUTO` for the batch and sequence dimensions of every tensor input: export keeps dynamic
    what the model lets vary and specialises the rest (a size fixed by a weight, a size of 1)."""
    bound = signature.bind(*args, **kwargs)
    return {name: tree_map(_automatic_dimensions, value) for name, value in bound.arguments.items()}


def _automatic_dimensions(leaf: Any) -> dict[int, Any] | None:
    """Dim.AUTO for a tensor's leading dimensions; None for a scalar or a value (an empty dict would be
    read as a structure of its own)."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
        return {dim: Dim.AUTO for dim in range(min(leaf.dim(), DYNAMIC_DIMENSIONS))}
    return None


def _keywords_named(
    model: torch.nn.Module, signature: inspect.Signature, kwargs: Mapping[str, Any]
) -> tuple[torch.nn.Module, inspect.Signature]:
    """The root, or, when the call passes keywords to its `**kwargs` (the Trainer's
    `num_items_in_batch`), a stand-in whose forward names them: torch.export (2.13) fails on dynamic
    shapes given for a `**kwargs` parameter. The stand-in shares everything with the model (a shallow
    copy of another class), so the graph fetches the model's own tensors under the same names."""
    parameters = list(signature.parameters.values())
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return model, signature
    named = [p for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        for name in kwargs
        if name not in signature.parameters
    ]
    explicit = signature.replace(parameters=named)
    model_forward = type(model).forward

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return model_forward(self, *args, **kwargs)

    itself = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = explicit.replace(parameters=[itself, *named])  # type: ignore[attr-defined]
    stand_in = copy.copy(model)
    stand_in.__class__ = type(type(model).__name__, (type(model),), {"forward": forward})
    return stand_in, explicit


def _export_root(
    model: torch.nn.Module, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, bool]:
    """The exported program of the root's forward and whether its dimensions are dynamic: dynamic
    where export manages, else specialised to the example's shapes."""
    with quiet_export(), _root_hooks_suspended(model):
        try:
            root, explicit = _keywords_named(model, signature, kwargs)
            dynamic_shapes = _dynamic_shapes(explicit, args, kwargs)
            return torch.export.export(root, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes), True
        except Exception as error:  # noqa: BLE001 - a static export may still work
            log.info("torch.export with dynamic shapes failed (%s); exporting the example's shapes", error)
        return torch.export.export(model, args, kwargs, strict=False), False


def _capture_export(
    model: torch.nn.Module, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Capture:
    """Capture with torch.export (non-strict, training IR), with dynamic dimensions where it can."""
    hooked = hooked_submodules(model)
    if hooked:
        raise UnsupportedModel(
            f"torch.export would inline submodules {hooked[:4]} and run their hooks once, at capture, "
            "never in training (see NOTE [hooks] in planner/capture/chain.py; remove the hooks while "
            "planning or make the forward traceable by torch.fx, which calls hooked submodules)"
        )
    call = GraphCall(signature=signature)
    kwargs = call._ordered(kwargs)  # the graph's flat inputs follow the forward's parameter order
    try:
        exported, dynamic = _export_root(model, signature, args, kwargs)
    except Exception as error:  # noqa: BLE001 - any export failure is a reason to try a coarser level
        raise UnsupportedModel(
            f"torch.export cannot trace {type(model).__name__}: {_describe(error)} (branch with "
            "torch.cond or torch.where instead of Python if on tensor values)"
        ) from error
    graph_module = exported.module()
    assert isinstance(graph_module, fx.GraphModule)
    check_shared_state(graph_module, model)
    guards = getattr(graph_module, EXPORT_GUARDS_MODULE, None)
    drop_export_guards(graph_module)
    _run_out_of_place(graph_module, model)
    _, spec = tree_flatten((args, kwargs))
    exported_shapes = None
    if dynamic:
        exported_shapes = ExportedShapes(
            placeholders=tuple(graph_module.graph.find_nodes(op="placeholder")),
            range_constraints=dict(exported.range_constraints),
            guards=guards,
        )
    call = dataclasses.replace(
        call,
        example_spec=spec,
        example_shapes=call_shapes(args, kwargs),
        example_layouts=_layouts(args, kwargs),
        exported_shapes=exported_shapes,
    )
    return Capture(
        graph_module=graph_module,
        path=CapturePath.EXPORT.value,
        opaque_modules=(),
        call=call,
        inputs=call.graph_inputs(args, kwargs),
    )


def _bind_example(
    model: torch.nn.Module, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> inspect.BoundArguments:
    try:
        return signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"the example inputs do not fit {type(model).__name__}.forward{signature}: {error}. Pass the "
            "forward's positional arguments as example_inputs and its keyword arguments as example_kwargs."
        ) from error


def _drop_tracebacks(errors: Sequence[BaseException]) -> None:
    """Forget the tracebacks of failures that a later level made up for. A traceback holds its frames
    and their callers', and the exceptions holding it form a cycle with the frame that kept them: until
    the garbage collector runs, that would keep alive whatever those frames held (a capture inside a
    training step would keep the step's outputs alive, and the step's peak would grow)."""
    for error in errors:
        cause: BaseException | None = error
        while cause is not None:
            cause.__traceback__ = None
            cause = cause.__cause__ or cause.__context__


def capture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> Capture:
    """Capture `model` at the finest level that works for its example call; see the module docstring.

    Without an example call only FX is tried (torch.export needs example tensors).
    Raises UnsupportedModel naming each level's failure when no level works.
    """
    signature = inspect.signature(model.forward)
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    has_example = bool(args or kwargs)
    example = _bind_example(model, signature, args, kwargs) if has_example else None
    failures: list[UnsupportedModel] = []
    try:
        return _capture_fx(model, signature, example)
    except UnsupportedModel as error:
        log.info("%s; trying torch.export", error)
        failures.append(error)
    if has_example:
        try:
            captured = _capture_export(model, signature, args, kwargs)
        except UnsupportedModel as error:
            failures.append(error)
        else:
            _drop_tracebacks(failures)
            return captured
    reasons = "; ".join(str(failure) for failure in failures)
    untried = "" if has_example else "; torch.export was not tried: it needs example inputs"
    raise UnsupportedModel(f"cannot capture {type(model).__name__}: {reasons}{untried}") from failures[-1]
