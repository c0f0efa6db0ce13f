"""Every checkpointing method a user applies by hand that we can run, in one place (issue 35).

Why it exists: the planner promises that no answer it gives (a lowest peak, a capacity size, a point of
the frontier) is beaten by what a user could do without it, so the tests and the benches must run the
same hand methods, built the same way. They are:

- "every <Type>" (`every_instance`): non-reentrant `checkpoint_wrapper` on every outermost instance of
  one module type, for each type with at least two instances that hold parameters
  (`repeated_module_types`): blocks, layers, experts, and single Linear or norm layers too; and for each
  type with one instance that the forward calls more than once (`shared_module_types`: ALBERT's one
  layer, run at every depth), so that checkpointing it checkpoints every call. Types whose
  instances carry hooks are left out by `hand_methods` (`hook_free_types`): a replay runs their hooks a
  second time (a counting hook would count twice), so the planner does not checkpoint them and the hand
  method is not a correct peer there;
- "every block" (`every_block`): `checkpoint_wrapper` on each child of the model's block container (its
  Sequential or ModuleList with the most children, else the root's own children);
- "sqrt(n) segments" (`sqrt_segments`): what `torch.utils.checkpoint.checkpoint_sequential` does, sqrt(n)
  equal segments of the block container, all but the last checkpointed; on a ModuleList only where the
  forward runs its children as a chain `x = child(x)` (`chain_violation`);
- "own switch" (`own_switch`): the model's library's own switch, where it has one: Hugging Face's
  `gradient_checkpointing_enable()` (`activation_checkpointing_enable()` in transformers 5), timm's
  `set_grad_checkpointing()` and diffusers' `enable_gradient_checkpointing()`, each non-reentrant.

Each method is built on a deep copy of the model and returned as a `HandMethod` whose `variant`
(planner/testing/steps.py) names parameters and buffers as the model does, or None with the reason the
method does not apply to this model in `description`.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.hooks import RemovableHandle

from planner.capture.chain import has_hooks
from planner.report.blocks import longest_block_stack
from planner.testing.steps import Variant, fresh_inputs, fresh_kwargs, variant_of

__all__ = [
    "EVERY_BLOCK",
    "OWN_SWITCH",
    "SQRT_SEGMENTS",
    "BlockContainer",
    "HandMethod",
    "checkpoint_every_instance",
    "every_block",
    "every_instance",
    "every_instance_name",
    "find_block_container",
    "hand_methods",
    "hook_free_types",
    "outermost_instances",
    "own_switch",
    "repeated_module_types",
    "shared_module_types",
    "sqrt_segments",
    "without_hooks",
]

SQRT_SEGMENTS = "sqrt(n) segments"
EVERY_BLOCK = "every block"
OWN_SWITCH = "own switch"
MIN_CONTAINER_CHILDREN = 3
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
NO_REENTRANT = {"use_reentrant": False}


@dataclass(frozen=True)
class HandMethod:
    """One hand method on a copy of a model: `variant` is None where it does not apply, and
    `description` then says why; else it says what was checkpointed."""

    name: str
    variant: Variant | None
    description: str


def every_instance_name(module_type: type) -> str:
    return f"every {module_type.__name__}"


def _outermost(module: nn.Module, inside: frozenset[type], found: dict[type, list[nn.Module]]) -> None:
    for child in module.children():
        kind = type(child)
        if kind not in inside and not isinstance(child, CONTAINERS) and any(True for _ in child.parameters()):
            found.setdefault(kind, []).append(child)
        _outermost(child, inside | {kind}, found)


def outermost_instances(model: nn.Module) -> dict[type, list[nn.Module]]:
    """Module class -> its outermost instances (one nested in another of its class does not count; a
    module reached from two parents counts twice), leaving out containers and modules without
    parameters (a ReLU, a Dropout)."""
    found: dict[type, list[nn.Module]] = {}
    _outermost(model, frozenset(), found)
    return found


def repeated_module_types(model: nn.Module) -> list[type]:
    """Module classes with at least two outermost instances."""
    instances = outermost_instances(model)
    return sorted(
        (kind for kind, found in instances.items() if len(found) >= 2), key=lambda kind: kind.__name__
    )


def _probe_forward(
    probe: nn.Module,
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    handles: Sequence[RemovableHandle],
) -> None:
    """One forward of `probe` (a copy: it may change) on fresh copies of the inputs, without grad and with
    the RNG left as it was; removes the probe's hook `handles` afterwards, whether it raised or not."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            probe(*fresh_inputs(inputs), **fresh_kwargs(kwargs))
    finally:
        for handle in handles:
            handle.remove()


def shared_module_types(
    model: nn.Module, inputs: Sequence[Any], *, kwargs: Mapping[str, Any] | None = None
) -> list[type]:
    """Module classes with one outermost instance that one forward calls at least twice: weights shared
    across depth (ALBERT runs its one layer `num_hidden_layers` times, a looped block its body). Counted
    on a copy with forward pre-hooks; checkpointing that instance checkpoints every call."""
    probe = copy.deepcopy(model)
    single = {kind: found[0] for kind, found in outermost_instances(probe).items() if len(found) == 1}
    calls = dict.fromkeys(single, 0)

    def counter(kind: type) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_module: nn.Module, _args: tuple[Any, ...]) -> None:
            calls[kind] += 1

        return hook

    handles = [module.register_forward_pre_hook(counter(kind)) for kind, module in single.items()]
    _probe_forward(probe, inputs, kwargs, handles)
    return sorted((kind for kind, count in calls.items() if count >= 2), key=lambda kind: kind.__name__)


def without_hooks(model: nn.Module, kinds: Sequence[type]) -> list[type]:
    """Those of `kinds` none of whose instances in `model` carries hooks."""
    return [
        kind
        for kind in kinds
        if not any(isinstance(module, kind) and has_hooks(module) for module in model.modules())
    ]


def hook_free_types(model: nn.Module) -> list[type]:
    """Repeated module types none of whose instances carries hooks."""
    return without_hooks(model, repeated_module_types(model))


def _wrap_instances(module: nn.Module, module_type: type) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, module_type):
            setattr(module, name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        else:
            _wrap_instances(child, module_type)


def checkpoint_every_instance(model: nn.Module, module_type: type) -> nn.Module:
    """A deep copy with every outermost instance of `module_type` under non-reentrant
    `checkpoint_wrapper`: how users checkpoint every block by hand."""
    return every_instance(model, module_type).module


def every_instance(model: nn.Module, module_type: type) -> Variant:
    """ "every <Type>": a deep copy with every outermost instance of `module_type` checkpointed."""
    variant = variant_of(copy.deepcopy(model))
    _wrap_instances(variant.module, module_type)
    return variant


@dataclass(frozen=True)
class BlockContainer:
    """Where a model's repeated blocks live: a Sequential, a ModuleList, or the root's own children."""

    path: str
    kind: str
    child_names: tuple[str, ...]


def find_block_container(model: nn.Module) -> BlockContainer:
    """The root if it is a Sequential, else the Sequential/ModuleList with most children, else the root."""
    if isinstance(model, nn.Sequential):
        return BlockContainer(path="", kind="Sequential", child_names=tuple(model._modules))
    stack = longest_block_stack(model)
    if stack is not None and len(stack[1]) >= MIN_CONTAINER_CHILDREN:
        path, module = stack
        return BlockContainer(path=path, kind=type(module).__name__, child_names=tuple(module._modules))
    return BlockContainer(path="", kind="root children", child_names=tuple(model._modules))


def replace_submodule(root: nn.Module, path: str, replacement: nn.Module) -> nn.Module:
    """Put `replacement` at `path` in `root`; returns the root (`replacement` itself when path is '')."""
    if not path:
        return replacement
    parent_path, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent_path), leaf, replacement)
    return root


def chain_violation(
    model: nn.Module,
    container: BlockContainer,
    inputs: Sequence[Any],
    *,
    kwargs: Mapping[str, Any] | None = None,
) -> str | None:
    """Why the model's forward does not run the container's children as a chain x = child(x), or None.

    Checked on a copy with forward hooks: each child must be called once, in order, with one positional
    tensor that is the previous child's output. Only then can consecutive children be regrouped.
    """
    probe = copy.deepcopy(model)
    parent = probe.get_submodule(container.path)
    calls: list[tuple[str, tuple[Any, ...], Any]] = []

    def recorder(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            calls.append((name, args, output))

        return hook

    handles = [getattr(parent, name).register_forward_hook(recorder(name)) for name in container.child_names]
    _probe_forward(probe, inputs, kwargs, handles)
    called = tuple(name for name, _, _ in calls)
    if called != container.child_names:
        return f"the forward calls the blocks as {list(called)}, not once each in order"
    for (_, _, previous_output), (name, args, _) in itertools.pairwise(calls):
        if len(args) != 1 or args[0] is not previous_output:
            return f"block {name!r} does not take the previous block's output alone (ops run between blocks)"
    return None


def forward_failure(
    module: nn.Module, inputs: Sequence[Any], *, kwargs: Mapping[str, Any] | None = None
) -> str | None:
    """Why a forward of `module` (a copy: its BatchNorm statistics move) raises, or None. A regrouped
    container can break its owner's forward: `nn.TransformerEncoder` reads `self.layers[0].self_attn`."""
    try:
        _probe_forward(module, inputs, kwargs, [])
    except Exception as error:  # noqa: BLE001 - any failure means the method does not apply as built
        return f"{type(error).__name__}: {error}"
    return None


class CheckpointedSequential(nn.Module):
    """An nn.Sequential run by `checkpoint_sequential`: `segments` segments, all but the last checkpointed."""

    def __init__(self, sequential: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.sequential = sequential
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.sequential, self.segments, x, use_reentrant=False)


def segment_count(block_count: int) -> int:
    return max(1, round(math.sqrt(block_count)))


def grouped_module_list(blocks: nn.ModuleList, segments: int) -> nn.ModuleList:
    """The blocks regrouped as `checkpoint_sequential` would: equal checkpointed segments, then the rest."""
    children = list(blocks)
    size = len(children) // segments
    groups: list[nn.Module] = [
        checkpoint_wrapper(
            nn.Sequential(*children[start : start + size]), checkpoint_impl=CheckpointImpl.NO_REENTRANT
        )
        for start in range(0, size * (segments - 1), size)
    ]
    groups.append(nn.Sequential(*children[size * (segments - 1) :]))
    return nn.ModuleList(groups)


def sqrt_segments(
    model: nn.Module, inputs: Sequence[Any], *, kwargs: Mapping[str, Any] | None = None
) -> HandMethod:
    """ "sqrt(n) segments" on a deep copy, or why it does not apply."""
    container = find_block_container(model)
    block_count = len(container.child_names)
    segments = segment_count(block_count)
    where = f"{container.kind} {container.path or '<root>'} ({block_count} blocks, {segments} segments)"
    if container.kind == "root children":
        return HandMethod(
            SQRT_SEGMENTS,
            None,
            f"{type(model).__name__} has no Sequential/ModuleList of >= {MIN_CONTAINER_CHILDREN} blocks; "
            f"its forward calls {list(container.child_names)} by name, so grouping them needs a rewritten "
            "forward",
        )
    if container.kind == "ModuleList":
        violation = chain_violation(model, container, inputs, kwargs=kwargs)
        if violation is not None:
            return HandMethod(SQRT_SEGMENTS, None, f"{where}: {violation}")
    variant = variant_of(copy.deepcopy(model))
    blocks = variant.module.get_submodule(container.path)
    if isinstance(blocks, nn.Sequential):
        replacement: nn.Module = CheckpointedSequential(blocks, segments)
        description = f"checkpoint_sequential over {where}"
    else:
        assert isinstance(blocks, nn.ModuleList)
        replacement = grouped_module_list(blocks, segments)
        description = f"checkpoint_wrapper on each of the first {segments - 1} equal groups of {where}"
    module = replace_submodule(variant.module, container.path, replacement)
    failure = forward_failure(copy.deepcopy(module), inputs, kwargs=kwargs)
    if failure is not None:
        return HandMethod(SQRT_SEGMENTS, None, f"{where}: regrouped, the forward fails: {failure}")
    return HandMethod(
        SQRT_SEGMENTS,
        Variant(module=module, parameters=variant.parameters, buffers=variant.buffers),
        description,
    )


def every_block(model: nn.Module) -> HandMethod:
    """ "every block": each child of the block container wrapped by `checkpoint_wrapper`."""
    container = find_block_container(model)
    variant = variant_of(copy.deepcopy(model))
    parent = variant.module.get_submodule(container.path)
    for name in container.child_names:
        wrapped = checkpoint_wrapper(getattr(parent, name), checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        setattr(parent, name, wrapped)
    description = (
        f"checkpoint_wrapper(NO_REENTRANT) on each of {len(container.child_names)} children of "
        f"{container.kind} {container.path or '<root>'}"
    )
    return HandMethod(EVERY_BLOCK, variant, description)


def _hugging_face_switch(module: nn.Module) -> str:
    """transformers 5 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable` (the
    old name still works, with a warning); either checkpoints every decoder/encoder layer."""
    switch = "activation_checkpointing"
    if not hasattr(module, f"{switch}_enable"):
        switch = "gradient_checkpointing"
    getattr(module, f"{switch}_enable")(**{f"{switch}_kwargs": NO_REENTRANT})
    return f"Hugging Face {switch}_enable(use_reentrant=False): every layer"


def _diffusers_switch(module: nn.Module) -> str:
    """diffusers' default checkpoint function is non-reentrant already."""
    getattr(module, "enable_gradient_checkpointing")()  # noqa: B009 (nn.Module's __getattr__ types it a Tensor)
    return "diffusers enable_gradient_checkpointing(): every block, non-reentrant"


def _timm_switch(module: nn.Module) -> str:
    getattr(module, "set_grad_checkpointing")(True)  # noqa: B009 (as above)
    return "timm set_grad_checkpointing(True): every block"


def _switch_of(model: nn.Module) -> Callable[[nn.Module], str] | None:
    if getattr(model, "supports_gradient_checkpointing", False):
        return _hugging_face_switch
    if getattr(model, "_supports_gradient_checkpointing", False) and hasattr(
        model, "enable_gradient_checkpointing"
    ):
        return _diffusers_switch
    if hasattr(model, "set_grad_checkpointing"):
        return _timm_switch
    return None


def own_switch(model: nn.Module) -> HandMethod:
    """ "own switch": the model's library's checkpointing switch on a copy, or why there is none."""
    switch = _switch_of(model)
    if switch is None:
        return HandMethod(
            OWN_SWITCH,
            None,
            f"{type(model).__name__} has no gradient_checkpointing_enable (Hugging Face), "
            "enable_gradient_checkpointing (diffusers) or set_grad_checkpointing (timm)",
        )
    variant = variant_of(copy.deepcopy(model))
    return HandMethod(OWN_SWITCH, variant, switch(variant.module))


def hand_methods(
    model: nn.Module, inputs: Sequence[Any], *, kwargs: Mapping[str, Any] | None = None
) -> list[HandMethod]:
    """Every hand method that applies to the model: "every <Type>" for each repeated (or shared), hook-free
    module type, "sqrt(n) segments" and "own switch" where they apply. "every block" (the benches' peer where
    a model has no switch) is left out to keep the zoo-wide test lean: where the block container's
    children are all of one type it is "every <Type>" of that type, less any instances elsewhere, and
    where they are mixed layers of a Sequential (seed000's Linear and ReLU) "sqrt(n) segments" groups
    the same children; it is not proven never to beat the planner where neither holds."""
    methods = [
        HandMethod(
            every_instance_name(kind), every_instance(model, kind), f"checkpoint_wrapper on every {kind}"
        )
        for kind in hook_free_types(model)
        + without_hooks(model, shared_module_types(model, inputs, kwargs=kwargs))
    ]
    methods += [sqrt_segments(model, inputs, kwargs=kwargs), own_switch(model)]
    return [method for method in methods if method.variant is not None]
