"""Tensors a forward makes from Python values, recorded as graph operators while FX traces.

Why it exists: the captured module must cost no more than the model it came from (issue 35), and FX
folds what it cannot see into constants the graph module holds for its life.

NOTE [factories while tracing]: FX records an operator only when an argument is a Proxy, so a tensor
a forward makes from Python values alone (`torch.arange(half)` for a diffusion model's timestep
frequencies, `torch.ones(n, n).triu(1)` for a causal mask, `torch.randn(shape)` for noise) is made
once, while tracing, and every value computed from it before it meets a traced tensor too; the graph
keeps the result as a `_tensor_constant` attribute. Eager makes such a tensor each step and frees it
after its last reader; the captured module held it for as long as it lived (zoo_dag's diffusion U-Net:
one 512-byte block, which its prediction counted and its eager model never holds), and a random one
drew its numbers once, at capture, so every step of the captured module added the same noise, and
other numbers than the model's under the same seed. While FX traces, `factories_recorded` records a
call of one of `FACTORIES` whose arguments hold no Proxy as an operator of the graph, so the captured
module makes it each step, as eager does. Where the forward then steers Python control flow by such a
value, tracing fails; the chain traces again with the deterministic ones folded (chain.py), as before.
A random draw is never folded (NOTE [random control flow]).

NOTE [random control flow]: a forward that skips a layer at random (LayerDrop: `if self.training and
float(torch.rand(())) < p: continue`) steers its control flow by a draw. Folded, the draw was made once,
at capture, and the graph kept the branch it took: a four-layer stack with LayerDrop 0.5 was captured
by FX without its third layer, and `plan.module` never ran that layer and always ran the others, a
model other than the user's, with every number of its plan. So the retry folds only the deterministic
factories (not `RANDOM`): with a random draw steering control flow tracing still fails there, the
module that draws it stays opaque (a call the planned module runs as written each step), and a root
forward that draws it is refused with the reason (NOTE [layers called at random] in planning/model.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["FACTORIES", "RANDOM", "factories_recorded"]

_FACTORY_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.linspace, torch.logspace,
    torch.tensor, torch.as_tensor, torch.tril_indices, torch.triu_indices,
    torch.rand, torch.randn, torch.randint, torch.randperm,
)  # fmt: skip
FACTORIES = frozenset(_FACTORY_FUNCTIONS)
"""Functions that make a tensor from Python values alone."""
RANDOM: frozenset[Callable[..., Any]] = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm})
"""Those whose values differ from call to call: never folded (NOTE [random control flow])."""


class _Recorder(TorchFunctionMode):
    """Turns a call of a factory on Python values into a graph operator of `tracer`."""

    def __init__(self, tracer: fx.Tracer, recorded: frozenset[Callable[..., Any]]) -> None:
        super().__init__()
        self.tracer = tracer
        self.recorded = recorded

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        if func in self.recorded and not any(isinstance(leaf, fx.Proxy) for leaf in leaves):
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)


def factories_recorded(tracer: fx.Tracer, *, folding: bool = False) -> contextlib.AbstractContextManager[Any]:
    """While `tracer` traces, record factory calls on Python values (NOTE [factories while tracing]); with
    `folding`, only the random ones (NOTE [random control flow])."""
    return _Recorder(tracer, RANDOM if folding else FACTORIES)
