"""The records of a capture: the level of the chain that made it (`CapturePath`), how a call of the model
maps onto the captured graph and which calls the graph admits (`GraphCall`, `ExportedShapes`), and the
capture itself (`Capture`).

Why it exists: these records outlive the capture that made them. The profiler, the rewrite, the module
level (model_call.py) and the planning of a model read them, and the planned module calls through
`GraphCall` at every step, while the tracing and exporting that make them (chain.py) run once. Here they
stand apart from that machinery, as the contract between capture and the stages after it.

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

import inspect
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import fx
from torch._export.utils import _check_input_constraints_for_graph
from torch.utils._pytree import TreeSpec, tree_flatten, tree_flatten_with_path

__all__ = [
    "Capture",
    "CapturePath",
    "ExportedShapes",
    "GraphCall",
    "TensorLayout",
    "call_shapes",
    "fx_path",
    "tensor_layouts",
    "tensor_shapes",
]

log = logging.getLogger(__name__)


class CapturePath(StrEnum):
    """The levels of the capture chain, finest first (the values `Capture.path` and `Plan.capture`
    start with); members are their string values."""

    FX = "fx"
    EXPORT = "export"
    MODULE = "module"
    """The model's own submodules as whole units (planner/capture/model_call.py)."""


def tensor_shapes(values: Any) -> tuple[tuple[int, ...] | None, ...]:
    leaves, _ = tree_flatten(values)
    return tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves)


def call_shapes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...] | None, ...]:
    """The tensor shapes of a call, leaf by leaf (None for a leaf that is not a tensor)."""
    return tensor_shapes((tuple(args), dict(kwargs)))


TensorLayout = tuple[torch.dtype, str, bool]
"""A tensor's dtype, device type and whether it is contiguous: what an export specialises besides
shapes (it asserts dtypes, places new tensors on the example's device, traces views for its strides)."""


def tensor_layouts(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[TensorLayout | None, ...]:
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
    verdicts: dict[tuple[Any, ...], bool] = field(default_factory=dict, compare=False, repr=False)
    """`admit`'s answers by `_shape_key`: NOTE [admission per shape]."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ExportedShapes:
        """Shared, not copied: it describes shapes and holds no model state (its placeholders' values
        are fake tensors, which cannot be copied), so a copy of a planned module uses it as it is."""
        return self

    def admit(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """NOTE [admission per shape]: export's checks read only the tensors' shapes and the other
        inputs' values, and run sympy on every call (0.2-0.4 ms of Python, 3-5 % of a small Llama's
        training step on a CPU), so each verdict is kept by those and checked once."""
        leaves, _ = tree_flatten((tuple(args), dict(kwargs)))
        key = _shape_key(leaves)
        if key is None:
            return self._check(args, kwargs)
        if key not in self.verdicts:
            self.verdicts[key] = self._check(args, kwargs)
        return self.verdicts[key]

    def _check(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
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


def _shape_key(leaves: list[Any]) -> tuple[Any, ...] | None:
    """Each leaf's shape (a tensor) or value (anything else), or None where a value is unhashable."""
    key = tuple(
        (torch.Tensor, tuple(leaf.shape)) if isinstance(leaf, torch.Tensor) else (type(leaf), leaf)
        for leaf in leaves
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


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
            return (
                self.pinned_shapes is None or tensor_shapes(self._bound(args, kwargs)) == self.pinned_shapes
            )
        args, kwargs = tuple(args), self._ordered(kwargs)
        _, spec = tree_flatten((args, kwargs))
        if spec != self.example_spec or tensor_layouts(args, kwargs) != self.example_layouts:
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
    nested_units: bool = False
    """At the module level: whether each unit's own children are units too (NOTE [nested units] in
    profiler/split_calls.py); not under FSDP, whose units are the modules it shards."""

    def label(self, split: Collection[str] = ()) -> str:
        """`path`, saying which opaque modules (or modules kept whole for their hooks) a profile
        split at their children's calls (NOTE [split calls] in simulation/step.py)."""
        if not self.path.startswith(CapturePath.FX):
            return self.path
        opaque = [name for name in self.opaque_modules if name not in split]
        return fx_path(opaque, list(self.exported_modules), sorted(split))


def fx_path(opaque: list[str], exported: list[str], split: list[str] | None = None) -> str:
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
