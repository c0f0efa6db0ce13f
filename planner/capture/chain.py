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
   rest, recording ranges and guards (NOTE [other shapes] in records.py); when that fails, the graph is
   specialised to the example's shapes. It is specialised to the example call's structure either way.
3. When neither works, `capture` raises `UnsupportedModel` naming the construct each level failed on
   and the workaround; `optimize` then plans the model by its submodules, running its forward as
   written (`"module"`, planner/capture/model_call.py), and raises only if that finds none to checkpoint.

NOTE [hooks]: hooks must behave as without checkpointing. The planned module shares the root's hook
dictionaries, so the root's hooks run once per call; both levels trace the root's `forward`, not its
`__call__`, so the hooks are not also traced into the graph. FX keeps a submodule with hooks as one
node that calls the module (its hooks run), and the profiler marks that node not checkpointable, so a
replay never runs the hooks a second time (but for the hooks of NOTE [replayable hooks]). torch.export
would inline such a submodule and run its hooks once, at capture, so the export level refuses models
whose submodules carry hooks.

NOTE [replayable hooks]: the hooks tensor parallelism puts on a Linear may run again in a replay.
`ColwiseParallel` and `RowwiseParallel` (torch/distributed/tensor/parallel/style.py) register, through
`distribute_module` (torch/distributed/tensor/_api.py, a lambda closing over a `functools.partial` of
the style's `_prepare_input_fn` or `_prepare_output_fn`), a forward pre-hook that makes the input a
DTensor (`DTensor.from_local`, and `redistribute` where the given layout is not the one wanted) and a
forward hook that redistributes the output (row-wise: an all-reduce) and hands on its local tensor. They
keep no state and their result depends only on the tensors they get, so a replay computes what the
first call did; the collective they run again must run on every rank at the same point of backward,
which one schedule for every rank gives (NOTE [tensor parallel plans] in planning/tensor_parallel.py).
Without this, every split Linear was a node no region could hold, and the lowest peak of a 4-block
Llama-style stack split in two was 12,588,032 B, where `checkpoint_wrapper` on every block measured
9,334,272 B. Only these two styles' hooks count as replayable; any other hook keeps its module out.

Neither level traces through a custom autograd Function, whose backward a trace would lose, nor a
tensor hook registered in a forward, nor a tensor a forward stores on its module, nor FX through a
switch of grad mode, which it would not record: the module doing any of them stays whole (NOTE [custom
autograd functions], NOTE [tensor hooks], NOTE [stored on the module], NOTE [grad mode while tracing]
in kept_whole.py).

FX records the tensors a forward makes from Python values (`torch.arange(n)`, `torch.randn(shape)`) as
operators, which it would fold into constants the module holds (NOTE [factories while tracing] in
factories.py). Both levels then run out of place the in-place ops whose writes nothing can observe
(NOTE [in-place ops] in in_place.py), and the export level drops the attention masks a trace
materialises where the model makes none (NOTE [materialised masks] in attention_masks.py). What a
capture is, and which calls its graph runs, are records.py's (`Capture`, `GraphCall`,
NOTE [other shapes]).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim
from torch.utils._pytree import tree_flatten, tree_map

from planner.capture.attention_masks import drop_size_only_masks
from planner.capture.factories import factories_recorded
from planner.capture.in_place import run_out_of_place
from planner.capture.kept_whole import refuse_traced_call, refused_while_tracing, stored_during
from planner.capture.lifted_scalars import scalars_given_back
from planner.capture.records import (
    Capture,
    CapturePath,
    ExportedShapes,
    GraphCall,
    call_shapes,
    fx_path,
    tensor_layouts,
    tensor_shapes,
)
from planner.capture.submodule_export import (
    EXPORT_GUARDS_MODULE,
    check_shared_state,
    drop_export_guards,
    inline_exported_containers,
    quiet_export,
)
from planner.errors import UnsupportedModel

__all__ = [
    "candidate_units",
    "capture",
    "has_hooks",
    "hooked_submodules",
    "replays_safely",
]

log = logging.getLogger(__name__)

MAX_OPAQUE_MODULES = 64
"""A model with more untraceable submodules than this is better served by the export level."""


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


REPLAYABLE_STYLES = ("ColwiseParallel.", "RowwiseParallel.")
"""Qualified-name prefixes of the parallel styles whose layout hooks may run again (NOTE [replayable
hooks])."""


def replays_safely(module: torch.nn.Module) -> bool:
    """True when a replay of `module`'s call computes what its first call did: it has no hooks, or
    only the layout hooks of ColwiseParallel and RowwiseParallel (NOTE [replayable hooks])."""
    if getattr(module, "_backward_pre_hooks", None) or getattr(module, "_backward_hooks", None):
        return False
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(_is_layout_hook(hook) for hook in hooks)


def _is_layout_hook(hook: object) -> bool:
    """Whether `hook` is `distribute_module`'s lambda around a replayable style's prepare function."""
    if getattr(hook, "__module__", None) != "torch.distributed.tensor._api":
        return False
    for cell in getattr(hook, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, functools.partial):
            qualified_name = getattr(value.func, "__qualname__", "")
            return qualified_name.startswith(REPLAYABLE_STYLES)
    return False


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

    def create_proxy(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> fx.Proxy:
        refuse_traced_call(kind, target)  # NOTE [tensor hooks] in kept_whole.py
        return super().create_proxy(kind, target, *args, **kwargs)

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


def _is_tensor_or_proxy(value: Any) -> bool:
    return isinstance(value, torch.Tensor | fx.Proxy)


@contextlib.contextmanager
def _proxies_are_tensors() -> Iterator[None]:
    """NOTE [is_tensor under FX]: a forward that turns a number into a tensor with `if not
    torch.is_tensor(t): t = torch.tensor([t])` (diffusers' UNets do so for the timestep) sees a Proxy,
    not a tensor, while FX traces it, and the trace records `torch.tensor([t])` on the input tensor,
    which fails when the graph runs. The values FX traces with Proxies are the example call's tensors
    (its other arguments are concrete) and what operators made of them, so while tracing
    `torch.is_tensor` answers True for a Proxy, as it would for the tensor the Proxy stands for."""
    original = torch.is_tensor
    torch.is_tensor = _is_tensor_or_proxy  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_tensor = original


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
    recording = True  # NOTE [factories while tracing] in factories.py
    while True:
        tracer = _OpaqueTracer(opaque)
        with stored_during(model) as stored:
            try:
                with (
                    _proxies_are_tensors(),
                    factories_recorded(tracer, folding=not recording),
                    refused_while_tracing(fake_tensors=False),
                ):
                    graph = tracer.trace(model, concrete_args=concrete)
            except Exception as error:  # noqa: BLE001 - any tracing failure is a reason to try a coarser level
                if recording:  # the same modules again, deterministic factories folded as FX folds them
                    recording = False
                    continue
                recording = True
                failing = _failing_module(model, error)
                if failing is None or failing == "" or failing in opaque or len(opaque) >= MAX_OPAQUE_MODULES:
                    where = f"submodule {failing!r}" if failing else f"the forward of {type(model).__name__}"
                    raise UnsupportedModel(
                        f"torch.fx cannot trace {where}: {_describe(error)} (FX follows tensor operations "
                        "and module calls, not control flow on tensor values or item assignment: move such "
                        "code into a submodule, which FX keeps as one opaque node, or branch with "
                        "torch.where)"
                    ) from error
                log.info("fx could not trace %s (%s); keeping it opaque", failing, type(error).__name__)
                opaque.add(failing)
                continue
        if stored.modules:
            if "" in stored.modules or set(stored.modules) <= opaque:
                raise UnsupportedModel(
                    f"torch.fx cannot trace the forward of {type(model).__name__}: it stores a tensor on the "
                    "module, which a graph would not store (NOTE [stored on the module])"
                )
            log.info("%s store tensors on themselves; keeping them opaque", stored.modules)
            opaque.update(stored.modules)
            continue
        graph_module = fx.GraphModule(tracer.root, graph, type(model).__name__)
        exported = inline_exported_containers(graph_module, model, opaque, example) if example else []
        run_out_of_place(graph_module, model)
        scalars_given_back(graph_module)
        call = GraphCall(signature=signature)
        inputs = call.graph_inputs(example.args, example.kwargs) if example is not None else ()
        if exported:
            call = dataclasses.replace(call, pinned_shapes=tensor_shapes(inputs))
        still_opaque = sorted(opaque - set(exported))
        return Capture(
            graph_module=graph_module,
            path=fx_path(still_opaque, exported),
            opaque_modules=tuple(still_opaque),
            call=call,
            inputs=inputs,
            exported_modules=tuple(exported),
        )


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
    with quiet_export(), _root_hooks_suspended(model), refused_while_tracing(fake_tensors=True):
        try:
            root, explicit = _keywords_named(model, signature, kwargs)
            dynamic_shapes = _dynamic_shapes(explicit, args, kwargs)
            return torch.export.export(root, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes), True
        except Exception as error:  # noqa: BLE001 - a static export may still work
            log.info("torch.export with dynamic shapes failed (%s); exporting the example's shapes", error)
        return torch.export.export(model, args, kwargs, strict=False), False


def _unaliased(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example call with every tensor passed more than once replaced, after its first place, by a
    copy, for torch.export alone.

    NOTE [aliased example inputs]: Hugging Face's causal LMs are called `model(input_ids=ids,
    labels=ids)`. Non-strict export maps each example tensor to one graph input, so the same tensor
    passed twice becomes the later input everywhere: the captured Llama embedded `labels`, and trained
    on the labels as tokens whenever a batch passed two different tensors (its loss was that of
    `(labels, labels)`). Copies give each argument its own input; the graph still runs with the
    example's own tensors, one storage as the user passes it."""
    seen: set[int] = set()

    def distinct(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in seen:
            seen.add(id(leaf))
            return leaf
        return leaf.detach().clone().requires_grad_(leaf.requires_grad)

    distinct_args, distinct_kwargs = tree_map(distinct, (args, kwargs))
    return tuple(distinct_args), distinct_kwargs


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
    with stored_during(model) as stored:
        try:
            exported, dynamic = _export_root(model, signature, *_unaliased(args, kwargs))
        except Exception as error:  # noqa: BLE001 - any export failure is a reason to try a coarser level
            raise UnsupportedModel(
                f"torch.export cannot trace {type(model).__name__}: {_describe(error)} (branch with "
                "torch.cond or torch.where instead of Python if on tensor values)"
            ) from error
    if stored.modules:
        raise UnsupportedModel(
            f"torch.export cannot keep what the forward of {stored.modules[:4]} stores on the module "
            "(NOTE [stored on the module])"
        )
    graph_module = exported.module()
    assert isinstance(graph_module, fx.GraphModule)
    check_shared_state(graph_module, model)
    guards = getattr(graph_module, EXPORT_GUARDS_MODULE, None)
    drop_export_guards(graph_module)
    run_out_of_place(graph_module, model)
    scalars_given_back(graph_module)
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
        example_layouts=tensor_layouts(args, kwargs),
        exported_shapes=exported_shapes,
    )
    inputs = call.graph_inputs(args, kwargs)
    drop_size_only_masks(graph_module, inputs)
    return Capture(
        graph_module=graph_module,
        path=CapturePath.EXPORT.value,
        opaque_modules=(),
        call=call,
        inputs=inputs,
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
