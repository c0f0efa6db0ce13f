"""Turns a model into a torch.fx GraphModule that the planner can profile and rewrite.

`torch.fx.symbolic_trace` is tried first. It fails on Python control flow that depends on tensor values
(`if x.mean() > 0:`). Rather than giving up, the capture finds the innermost submodule whose `forward`
raised (from the traceback), keeps that submodule as one opaque node, and traces again. The planner then
checkpoints such a submodule whole or not at all. When the failing code is the root's own forward,
there is nothing left to keep opaque and `UnsupportedModel` names the construct.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import torch
from torch import fx

from planner.errors import UnsupportedModel

__all__ = ["Capture", "capture"]

log = logging.getLogger(__name__)

MAX_OPAQUE_MODULES = 64
"""A model with more untraceable submodules than this is better served by module-level planning."""


@dataclass(frozen=True)
class Capture:
    """A traced model and the path that produced it."""

    graph_module: fx.GraphModule
    path: str
    opaque_modules: tuple[str, ...]


class _OpaqueTracer(fx.Tracer):
    """The default tracer, but the named submodules stay single call_module nodes."""

    def __init__(self, opaque: set[str]) -> None:
        super().__init__()
        self.opaque = opaque

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.opaque or super().is_leaf_module(module, qualified_name)


def _failing_module(model: torch.nn.Module, error: BaseException) -> str | None:
    """Qualified name of the innermost module whose forward is on the traceback of `error`."""
    names = {id(module): name for name, module in model.named_modules()}
    innermost: str | None = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and owner is not None and id(owner) in names:
            innermost = names[id(owner)]
    return innermost


def capture(model: torch.nn.Module) -> Capture:
    """Trace `model` with FX, keeping untraceable submodules opaque; raise UnsupportedModel if impossible."""
    opaque: set[str] = set()
    while True:
        tracer = _OpaqueTracer(opaque)
        try:
            graph = tracer.trace(model)
        except Exception as error:  # noqa: BLE001 - any tracing failure is a reason to try a coarser level
            failing = _failing_module(model, error)
            if failing is None or failing == "" or failing in opaque or len(opaque) >= MAX_OPAQUE_MODULES:
                where = f"submodule {failing!r}" if failing else f"the forward of {type(model).__name__}"
                raise UnsupportedModel(
                    f"torch.fx cannot trace {where}: {type(error).__name__}: {error}. "
                    "Move data-dependent control flow (if/for on tensor values) into a submodule, "
                    "which the planner then treats as one opaque node, or replace it with torch.where."
                ) from error
            log.info("fx could not trace %s (%s); keeping it opaque", failing, type(error).__name__)
            opaque.add(failing)
            continue
        graph_module = fx.GraphModule(tracer.root, graph, type(model).__name__)
        path = "fx" if not opaque else f"fx (opaque: {', '.join(sorted(opaque))})"
        return Capture(graph_module=graph_module, path=path, opaque_modules=tuple(sorted(opaque)))
