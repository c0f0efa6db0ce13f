"""Emits the checkpointed module for a schedule.

Each CHECKPOINT region of the traced graph is fused into one submodule call (`fuse_by_partitions`)
that runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)`.
That choice answers three traps users hit by hand:

- non-reentrant checkpointing computes gradients for parameters even when no input requires grad, so
  an input without grad never freezes the first block's weights (reentrant checkpointing does);
- the RNG state is restored for the replay, so dropout draws the same mask twice;
- buffers (BatchNorm running statistics) are saved before the replay and restored after it, so they
  are updated once per step, as without checkpointing.

The result is an instance of a subclass of the model's own class that shares the original's
submodules, parameters and buffers (so `state_dict` keys, `isinstance` and the optimizer's parameter
list are unchanged). NOTE [drop-in]: training stacks look at the model, not only call it, so the
subclass keeps the class's name, module and qualified name (Hugging Face's `save_pretrained` writes
`architectures` from it, and the original class's `from_pretrained` loads the result) and its
`forward` carries the original's signature (`inspect.signature` is what the Trainer filters a batch's
columns by, and what accelerate and PEFT read). `gradient_checkpointing_enable()` raises: a second
layer of checkpointing would replay regions twice and was not planned. Only in training with grad
enabled does it run the planned graph; in eval or under `no_grad` it runs the model's own forward,
since nothing is saved for backward there. Calls at other shapes than the example's run on the
graph that admits them (planner/rewrite/other_shapes.py).

NOTE [FSDP2]: the planned graph inlines the operations of the model's blocks and calls their leaf
modules directly, so FSDP2's `fully_shard` hooks on a block (all-gather before its forward, reshard and
reduce-scatter after its backward) never run and the graph would compute with sharded DTensors it
does not expect. A planned graph therefore refuses to train once `fully_shard` has been applied to any
module it reaches (`_refuse_fully_sharded`). Plans for FSDP are made at the module level
(`optimize(..., sharding="fsdp")`): each checkpointed unit is a `CheckpointedUnit`, whose `forward`
runs under checkpoint *inside* the unit's FSDP hooks, so the pre-backward hook all-gathers the
parameters before the replay needs them, as with `checkpoint_wrapper` under `fully_shard`.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import sys
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.capture.kept_whole import drawing_generators, set_drawing_generators
from planner.capture.records import Capture
from planner.errors import UnplannedStep, UnsupportedModel, format_bytes
from planner.ir import ActivationGraph, Schedule, TrainingStep
from planner.profiler.selective_cost import saved_when_kept
from planner.rewrite.other_shapes import CallDispatch, RegionNodes, regions_of

__all__ = [
    "CheckpointedRegion",
    "CheckpointedUnit",
    "add_forward_pre_hook",
    "fully_sharded_modules",
    "guard_gradients",
    "planned_class",
    "planned_graph_of",
    "rewrite",
    "with_checkpointed_units",
]

DISPATCH_ATTRIBUTE = "_planner_calls"
REGION_PREFIX = "checkpointed_region_"
MODEL_FORWARD_ATTRIBUTE = "_planner_model_forward"


@contextmanager
def _buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Undo any buffer update made inside the block (a checkpoint replay must not count twice)."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _python_draws_replayed() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """NOTE [Python draws replayed]: checkpoint restores torch's generators for a replay, not Python's or
    NumPy's. A module the capture keeps whole because it draws from them (NOTE [Python draws] in
    capture/kept_whole.py: a layer that skips itself when `random.random()` says so) then drew again in
    its replay: checkpointed at the lowest budget, a layer that ran in the forward was skipped in the
    replay under 3 of 8 seeds, and backward raised CheckpointError (5 tensors saved, 0 recomputed). The
    forward context notes the generators' states; the replay's sets them back for the replay and
    restores the states it found after it, as checkpoint does for torch's. Only checkpoints holding a
    node that drew when profiled (`Node.draws_python`) pay for it (about 0.1 ms a call), and under
    torch.compile they run eagerly with these contexts (as NOTE [checkpointed breaks] runs those with
    buffers): compiled as a checkpoint, the replay drew again, and Python's generator was left where
    the model's own compiled step did not leave it, under 2 of 4 seeds."""
    drawn_from: dict[str, Any] = {}

    @contextmanager
    def forward() -> Iterator[None]:
        drawn_from.update(drawing_generators())
        yield

    @contextmanager
    def replay() -> Iterator[None]:
        found = drawing_generators()
        set_drawing_generators(drawn_from)
        try:
            yield
        finally:
            set_drawing_generators(found)

    return forward(), replay()


_KEEPING: contextvars.ContextVar[bool] = contextvars.ContextVar("planner_keeping", default=False)


def _begin_keep() -> None:
    """Marker placed before a kept node: its operators' outputs are saved (see NOTE [selective keeps])."""
    if not torch.compiler.is_compiling():  # see NOTE [torch.compile]
        _KEEPING.set(True)


def _end_keep() -> None:
    if not torch.compiler.is_compiling():
        _KEEPING.set(False)


def _keep_policy(context: Any, operator: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save what a kept node's operators allocate, less what `saved_when_kept` says to replay."""
    return (
        CheckpointPolicy.MUST_SAVE
        if _KEEPING.get() and saved_when_kept(operator)
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


@contextmanager
def _not_keeping() -> Iterator[None]:
    """Start a forward or replay outside any kept node (an early-stopped replay may leave the flag set)."""
    _KEEPING.set(False)
    yield


def _mark_kept_nodes(body: fx.GraphModule, keep_names: set[str]) -> None:
    """Bracket each kept node of `body` with `_begin_keep()` / `_end_keep()` calls."""
    for node in list(body.graph.nodes):
        if node.name in keep_names:
            with body.graph.inserting_before(node):
                body.graph.call_function(_begin_keep)
            with body.graph.inserting_after(node):
                body.graph.call_function(_end_keep)
    body.recompile()


class CheckpointedRegion(torch.nn.Module):
    """Runs `body` under non-reentrant checkpointing with RNG and buffer state preserved.

    Nodes named in `keep_names` run under a selective checkpoint policy that saves their outputs in
    forward, so the replay takes them from the cache instead of recomputing them.
    """

    def __init__(
        self,
        body: fx.GraphModule,
        keep_names: set[str] | None = None,
        *,
        whole_calls: bool = False,
        draws_python: bool = False,
    ) -> None:
        super().__init__()
        self.body = body
        self.has_buffers = any(True for _ in body.buffers())
        self.draws_python = draws_python
        """Whether the replay sets Python's and NumPy's generators back (NOTE [Python draws replayed])."""
        self.selective = bool(keep_names)
        self.eager_under_compile = (whole_calls and self.has_buffers) or draws_python
        """Run this region eagerly, outside dynamo, when torch.compile compiles the planned module: it
        holds a whole call fx could not trace, and buffers its replay must restore (NOTE [checkpointed
        breaks]), or Python draws its replay must make again (NOTE [Python draws replayed])."""
        if keep_names:
            _mark_kept_nodes(body, keep_names)

    def _contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        forward: AbstractContextManager[Any] = nullcontext()
        replay: AbstractContextManager[Any] = nullcontext()
        if self.selective:
            forward, replay = create_selective_checkpoint_contexts(_keep_policy)
            forward, replay = _stacked(_not_keeping(), forward), _stacked(_not_keeping(), replay)
        if self.has_buffers:
            replay = _stacked(_buffers_restored(self.body), replay)
        if self.draws_python:
            forward_draws, replay_draws = _python_draws_replayed()
            forward, replay = _stacked(forward_draws, forward), _stacked(replay_draws, replay)
        return forward, replay

    def forward(self, *args: Any) -> Any:
        if not torch.compiler.is_compiling():
            return _checkpointed(self, args)
        if self.eager_under_compile:
            return _checkpointed_outside_dynamo(self, args)
        # NOTE [torch.compile]: under torch.compile the region becomes a checkpoint higher-order op
        # and AOTAutograd plans its replay: buffer updates are functionalized (applied once, in
        # forward) and the partitioner chooses what the backward recomputes, so the eager replay
        # contexts (buffer restore, selective keeps) do not apply and are not traced.
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True)


def _checkpointed(region: CheckpointedRegion, args: tuple[Any, ...]) -> Any:
    """`region` run eagerly under checkpoint, with the replay's contexts (buffers restored, keeps).

    NOTE [region calls]: checkpoint calls the body's `forward`, not the GraphModule. A replay stops
    early by raising an exception from its last pack hook, and a GraphModule's `__call__` catches
    every exception that passes through it to extract the stack (a file check per frame) before
    raising it again: on a small Hugging Face BERT that made each checkpointed region of its plan cost
    1.75 ms more than no checkpointing, where 1.22 ms without it (30 interleaved rounds, one CPU
    thread). The body holds no hooks of its own for `__call__` to run."""
    with _autocast_uncached():
        return checkpoint(
            region.body.forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=region._contexts,
        )


_checkpointed_outside_dynamo = torch.compiler.disable(_checkpointed)
"""NOTE [checkpointed breaks]: dynamo cannot split a checkpoint at a graph break. Where a checkpoint's
code breaks, dynamo gives up on the whole checkpoint and runs it eagerly, but from code it has already
traced down the compiling branch, without the replay's contexts: a planned ResNet-like block whose NaN
check breaks the graph updated its BatchNorm statistics twice per step, in a region holding the block
and in a unit of a plan made by submodules alike. So a checkpoint that may break and has buffers to
restore runs outside dynamo altogether when torch.compile compiles the planned module: eagerly, with
its contexts, whether or not dynamo would have broken in it (a graph break there, not a wrong step).
A region may break where it holds a whole split call (code FX could not trace, as data-dependent
branches are); a unit (a child call of a split call, or a submodule of a plan made by submodules) is
code the planner never traced, so any unit may. A checkpoint without buffers keeps dynamo: where it
breaks, its eager replay needs no contexts (the RNG is preserved either way)."""


UNIT_FORWARD_ATTRIBUTE = "_planner_unit_forward"
UNIT_BUFFERS_ATTRIBUTE = "_planner_unit_has_buffers"
"""Set on a wrapped unit that has buffers: compiled, it runs outside dynamo (NOTE [checkpointed breaks])."""
UNIT_DRAWS_ATTRIBUTE = "_planner_unit_draws_python"
"""Set on a wrapped unit that drew from Python's or NumPy's generators when profiled (NOTE [Python draws
replayed])."""


class CheckpointedUnit:
    """Runs one submodule under checkpoint in training, for plans made at the module level.

    `wrap` returns a shallow copy of the unit whose class is a subclass of the unit's own: the same
    parameters, buffers, submodules, hooks and state_dict keys, only `forward` checkpoints the unit's
    own forward (RNG replayed, buffers restored after the replay, as for CheckpointedRegion).
    """

    @staticmethod
    def wrap(unit: torch.nn.Module, *, draws_python: bool = False) -> torch.nn.Module:
        wrapped = copy.copy(unit)
        wrapped.__class__ = _checkpointed_class(type(unit))
        setattr(wrapped, UNIT_BUFFERS_ATTRIBUTE, any(True for _ in unit.buffers()))
        setattr(wrapped, UNIT_DRAWS_ATTRIBUTE, draws_python)
        return wrapped


_CHECKPOINTED_CLASSES: dict[type[torch.nn.Module], type[torch.nn.Module]] = {}
"""One checkpointing subclass per unit class, so that wrapped units of one class share a class."""


def _checkpointed_class(unit_class: type[torch.nn.Module]) -> type[torch.nn.Module]:
    if unit_class not in _CHECKPOINTED_CLASSES:
        _CHECKPOINTED_CLASSES[unit_class] = type(
            f"Checkpointed{unit_class.__name__}",
            (unit_class,),
            {"forward": _checkpointed_unit_forward, UNIT_FORWARD_ATTRIBUTE: unit_class.forward},
        )
    return _CHECKPOINTED_CLASSES[unit_class]


def _checkpointed_unit_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = functools.partial(getattr(type(self), UNIT_FORWARD_ATTRIBUTE), self)
    if not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    if not torch.compiler.is_compiling():
        return _unit_checkpointed(self, forward, args, kwargs)
    if getattr(self, UNIT_BUFFERS_ATTRIBUTE, False) or getattr(self, UNIT_DRAWS_ATTRIBUTE, False):
        # NOTE [checkpointed breaks], NOTE [Python draws replayed]
        return _unit_checkpointed_outside_dynamo(self, forward, args, kwargs)
    # NOTE [torch.compile]
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _unit_checkpointed(
    unit: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`unit` run eagerly under checkpoint, its buffers restored after the replay."""
    with _autocast_uncached():
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=functools.partial(_unit_contexts, unit),
            **kwargs,
        )


_unit_checkpointed_outside_dynamo = torch.compiler.disable(_unit_checkpointed)


def _unit_contexts(unit: torch.nn.Module) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    has_buffers = any(True for _ in unit.buffers())
    forward: AbstractContextManager[Any] = nullcontext()
    replay: AbstractContextManager[Any] = _buffers_restored(unit) if has_buffers else nullcontext()
    if getattr(unit, UNIT_DRAWS_ATTRIBUTE, False):
        forward_draws, replay_draws = _python_draws_replayed()
        forward, replay = forward_draws, _stacked(replay_draws, replay)
    return forward, replay


AUTOCAST_DEVICES = ("cpu", "cuda")


@contextmanager
def _autocast_uncached() -> Iterator[None]:
    """Keep autocast's cast cache off inside a checkpointed region.

    Autocast caches the bf16 copy of each weight until its outermost block ends, after the loss: in a
    checkpointed region that would keep the copies that checkpointing meant to drop, and the plan's
    prediction would miss them. Uncached, a copy lives as long as autograd needs it; the replay
    records and restores the same autocast state. (See NOTE [autocast] in profiler/measurement.py.)
    """
    with ExitStack() as stack:
        for device in AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
        yield


@contextmanager
def _stacked(*managers: AbstractContextManager[Any]) -> Iterator[None]:
    with ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _localize_attributes(graph: fx.Graph, partition: dict[fx.Node, int | None]) -> None:
    """Give `partition` its own get_attr nodes for the parameters and buffers it uses.

    A graph captured by torch.export fetches parameters and buffers with get_attr nodes outside any
    region; fused as they are, they would become inputs of the checkpointed call. Fetched inside, they
    become attributes of the region's body, the model's own tensor objects (so tied weights stay one
    Parameter), and the buffers the region updates in place (BatchNorm statistics) are restored after
    a replay, as for an FX-captured BatchNorm module.
    """
    first = min(partition, key=_position(graph))
    local: dict[fx.Node, fx.Node] = {}
    for node in list(partition):
        for source in node.all_input_nodes:
            if source.op != "get_attr":
                continue
            if source not in local:
                with graph.inserting_before(first):
                    local[source] = graph.get_attr(str(source.target))
                local[source].meta = dict(source.meta)
            node.replace_input_with(source, local[source])
    for source, copy_node in local.items():
        partition[copy_node] = None
        if not source.users:
            graph.erase_node(source)


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


def _in_graph_order(graph: fx.Graph, partition: dict[fx.Node, int | None]) -> dict[fx.Node, int | None]:
    """`partition` ordered as `graph` runs its nodes.

    NOTE [region order]: `fuse_by_partitions` lays out a region's body by a topological sort that keeps
    the partition's own order among independent nodes. The get_attr nodes `_localize_attributes` adds
    come last in the partition, so every node that reads a parameter was put off until nothing else was
    ready: in DeBERTa's disentangled attention a whole projection and a division moved past another
    branch's gather, and the replayed region held a 64 KiB gradient more in backward than the simulator,
    which runs each region in the graph's order, predicted (a plan 2.1 % over its budget). In graph
    order the body runs, and is replayed and differentiated, as predicted.
    """
    return dict.fromkeys(sorted(partition, key=_position(graph)))


def _split(graph_module: fx.GraphModule, regions: Sequence[RegionNodes]) -> fx.GraphModule:
    """Fuse each checkpointed region into one call of a CheckpointedRegion; leave the rest inline.

    Stored regions stay in the top-level graph, whose generated code frees each value after its last
    use, so their memory behaves exactly as in the original model. (Wrapping them in submodules too
    would keep their inputs alive for the whole call.)
    """
    split = fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph), type(graph_module).__name__)
    by_name = {node.name: node for node in split.graph.nodes}
    fused: list[tuple[RegionNodes, dict[fx.Node, int | None]]] = []
    for region in regions:
        if region.unit_path is not None:
            continue
        partition: dict[fx.Node, int | None] = {by_name[n]: None for n in region.names if n in by_name}
        if partition:
            _localize_attributes(split.graph, partition)
            fused.append((region, _in_graph_order(split.graph, partition)))
    fuse_by_partitions(
        split, [partition for _, partition in fused], prefix=REGION_PREFIX, always_return_tuple=True
    )
    for number, (region, _) in enumerate(fused):
        name = f"{REGION_PREFIX}{number}"
        body = getattr(split, name)
        region_module = CheckpointedRegion(
            body, set(region.keep), whole_calls=region.whole_calls, draws_python=region.draws_python
        )
        setattr(split, name, region_module)
    # NOTE [split calls] in simulation/step.py: a child call runs under checkpoint inside a copy of its caller
    units = [region.unit_path for region in regions if region.unit_path is not None]
    drawing = {region.unit_path for region in regions if region.unit_path is not None and region.draws_python}
    with_checkpointed_units(split, units, copy_root=False, drawing=drawing)
    split.recompile()
    return split


def with_checkpointed_units(
    root: torch.nn.Module, paths: list[str], *, copy_root: bool = True, drawing: Collection[str] = ()
) -> torch.nn.Module:
    """`root` (or with `copy_root` a shallow copy of it) in which the submodules at `paths` run under
    checkpoint (`CheckpointedUnit`), those in `drawing` replaying Python's draws (NOTE [Python draws
    replayed]). The modules on the way to them are shallow copies, so parameters, buffers and every
    other submodule stay the model's own, and the model is not changed."""
    planned = copy.copy(root) if copy_root else root
    if copy_root:
        planned._modules = dict(root._modules)
    for path in paths:
        parent = planned
        parts = path.split(".")
        for part in parts[:-1]:
            child = copy.copy(parent._modules[part])
            assert child is not None
            child._modules = dict(child._modules)
            parent._modules[part] = child
            parent = child
        unit = parent._modules[parts[-1]]
        assert unit is not None
        parent._modules[parts[-1]] = CheckpointedUnit.wrap(unit, draws_python=path in drawing)
    return planned


FSDP_MODULE = "torch.distributed.fsdp"
"""Where `FSDPModule` lives. `fully_shard` imports this package, so while it is not imported no module
can be sharded, and the check costs nothing (importing it would take most of a second)."""


def fully_sharded_modules(module: torch.nn.Module) -> list[str]:
    """Qualified names of the modules under `module` (itself: "") that FSDP2's `fully_shard` wraps."""
    fsdp = sys.modules.get(FSDP_MODULE)
    if fsdp is None:
        return []
    return [name for name, child in module.named_modules() if isinstance(child, fsdp.FSDPModule)]


def _refuse_fully_sharded(module: torch.nn.Module) -> None:
    """Raise `UnsupportedModel` when `fully_shard` wraps a module that a planned graph runs (NOTE [FSDP2])."""
    sharded = fully_sharded_modules(module)
    if sharded:
        names = ", ".join(repr(name or "<root>") for name in sharded[:4])
        raise UnsupportedModel(
            f"fully_shard (FSDP2) wraps {names}{', ...' if len(sharded) > 4 else ''} of a plan.module that "
            "runs a captured graph: the graph inlines the blocks' operations, so their FSDP hooks would not "
            "gather the parameters. Plan for FSDP with planner.optimize(model, ..., sharding='fsdp'), which "
            "keeps every block a module call, then fully_shard each block of plan.module and plan.module."
        )


def _planned_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    if self.training and torch.is_grad_enabled():
        _refuse_fully_sharded(self)
        dispatch: CallDispatch = getattr(self, DISPATCH_ATTRIBUTE)
        split, graph_args, graph_kwargs = dispatch.select(args, kwargs)
        return split(*graph_args, **graph_kwargs)
    return getattr(type(self), MODEL_FORWARD_ATTRIBUTE)(self, *args, **kwargs)


def _refuse_gradient_checkpointing(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    raise UnsupportedModel(
        f"gradient_checkpointing_enable() on a planned {type(self).__name__}: plan.module already "
        "checkpoints what its plan chose, and a second layer of checkpointing would replay regions twice "
        "and break the plan's memory figures. Train plan.module as it is (with the Hugging Face Trainer, "
        "leave TrainingArguments(gradient_checkpointing=False)), or call it on the original model instead "
        "of planning."
    )


_PLANNED_CLASSES: dict[tuple[type[torch.nn.Module], bool], type[torch.nn.Module]] = {}
"""One planned subclass per model class (and kind), so that plans of one class share a class."""


def planned_class(model_class: type[torch.nn.Module], *, runs_graph: bool) -> type[torch.nn.Module]:
    """The class of a planned module: a subclass of `model_class` that passes for it (NOTE [drop-in]).

    With `runs_graph` its `forward` runs the planned graph in training and the class's own forward
    otherwise, under the original forward's signature; without, the forward is the class's own (the
    module level checkpoints submodules instead).
    """
    key = (model_class, runs_graph)
    if key not in _PLANNED_CLASSES:
        namespace: dict[str, Any] = {
            "__module__": model_class.__module__,
            "__qualname__": model_class.__qualname__,
            "gradient_checkpointing_enable": _refuse_gradient_checkpointing,
        }
        if runs_graph:
            original = model_class.forward

            @functools.wraps(original)
            def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                return _planned_forward(self, *args, **kwargs)

            namespace |= {"forward": forward, MODEL_FORWARD_ATTRIBUTE: original}
        _PLANNED_CLASSES[key] = type(model_class.__name__, (model_class,), namespace)
    return _PLANNED_CLASSES[key]


def rewrite(
    model: torch.nn.Module, captured: Capture, graph: ActivationGraph, schedule: Schedule
) -> torch.nn.Module:
    """A drop-in replacement for `model` that checkpoints as `schedule` (a schedule of `graph`, the
    profiled graph of `captured`) says, at the example's shape and every other
    (planner/rewrite/other_shapes.py)."""
    dispatch = CallDispatch(model, captured, regions_of(graph, schedule), _split)
    planned = copy.copy(model)
    planned.__class__ = planned_class(type(model), runs_graph=True)
    object.__setattr__(planned, DISPATCH_ATTRIBUTE, dispatch)
    return planned


def guard_gradients(module: torch.nn.Module, step: TrainingStep) -> torch.nn.Module:
    """Make `module` refuse a training forward while a parameter holds a gradient, when `step` says
    gradients are set to None before every forward (NOTE [unplanned gradients]); returns `module`.

    NOTE [unplanned gradients]: a plan for one micro-batch after `zero_grad(set_to_none=True)` counts no
    gradient during forward. Gradient accumulation or `zero_grad(set_to_none=False)` keep every
    parameter's gradient alive there, which can exceed the budget by the size of all gradients. The
    planned module refuses that step at its first forward, rather than overrunning the budget silently;
    a plan made for that step (`TrainingStep(accumulation_steps=k)`) accepts it. Only a training forward
    with grad enabled is checked, so evaluation between backward and step still runs.
    """
    if step.gradients_in_forward:
        return module
    add_forward_pre_hook(module, _refuse_alive_gradients)
    return module


_LOOPS = (
    (
        ("pytorch_lightning.loops.optimization.automatic", "lightning.pytorch.loops.optimization.automatic"),
        "PyTorch Lightning's automatic optimization, which zeroes gradients between training_step and "
        "backward",
        "step=planner.TrainingStep.from_lightning(trainer)",
    ),
    (
        ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"),
        "a PyTorch Lightning or Fabric loop",
        "step=planner.TrainingStep.from_lightning(trainer) for automatic optimization, else "
        "step=planner.TrainingStep(accumulation_steps=k) for k accumulated micro-batches",
    ),
    (
        ("transformers.trainer",),
        "the Hugging Face Trainer with gradient accumulation",
        "step=planner.TrainingStep.from_training_args(training_args)",
    ),
    (
        ("accelerate",),
        "an accelerate loop that accumulates gradients",
        "step=planner.TrainingStep(accumulation_steps=k), k as in Accelerator(gradient_accumulation_steps=k)",
    ),
)
"""(module name prefixes on the call stack, the loop they run, the step to plan it with)."""


def _recognised_loop() -> tuple[str, str] | None:
    """(the training loop on the call stack, the `step=` that plans it) for the loops of `_LOOPS`."""
    modules = []
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        modules.append(str(frame.f_globals.get("__name__", "")))
        frame = frame.f_back
    for prefixes, loop, advice in _LOOPS:
        if any(
            module == prefix or module.startswith(prefix + ".") for module in modules for prefix in prefixes
        ):
            return loop, advice
    return None


def add_forward_pre_hook(
    module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False
) -> None:
    """Register `hook` on a planned module alone: it is a shallow copy of the model, whose hook tables
    it shares until it is given its own."""
    module._forward_pre_hooks = type(module._forward_pre_hooks)(module._forward_pre_hooks)
    module._forward_pre_hooks_with_kwargs = type(module._forward_pre_hooks_with_kwargs)(
        module._forward_pre_hooks_with_kwargs
    )
    module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)


def _refuse_alive_gradients(module: torch.nn.Module, _args: Any) -> None:
    if not (module.training and torch.is_grad_enabled()):
        return
    for name, parameter in module.named_parameters():
        if parameter.grad is not None:
            recognised = _recognised_loop()
            advice = (
                f"This looks like {recognised[0]}: plan it with planner.optimize(..., {recognised[1]})."
                if recognised is not None
                else "Plan the step you run: planner.optimize(..., step=planner.TrainingStep("
                "accumulation_steps=k)) for accumulation, TrainingStep(zero_grad_before_backward=True) "
                "for a loop that zeroes gradients between forward and backward, "
                "TrainingStep(zero_grad_set_to_none=False) for zero_grad(set_to_none=False); or call "
                "optimizer.zero_grad(set_to_none=True) before each forward."
            )
            raise UnplannedStep(
                f"plan.module ran a training forward while parameter {name!r} still holds a gradient "
                f"({format_bytes(parameter.grad.untyped_storage().nbytes())}) from an earlier backward. "
                "The plan is for one micro-batch after zero_grad(set_to_none=True) before the forward, which "
                "counts no gradient during forward; a loop that keeps gradients here can exceed the budget "
                f"by all of them. {advice}"
            )


def planned_graph_of(module: torch.nn.Module) -> fx.GraphModule:
    """The split graph a planned module runs in training at the example's shape (for inspection and
    tests)."""
    dispatch: CallDispatch = getattr(module, DISPATCH_ATTRIBUTE)
    return dispatch.example_split
