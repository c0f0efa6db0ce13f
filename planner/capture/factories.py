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
value, tracing fails; the chain traces again without recording them (chain.py), as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["FACTORIES", "factories_recorded"]

_FACTORY_FUNCTIONS: tuple[Callable[..., Any], ...] = (
    torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.linspace, torch.logspace,
    torch.tensor, torch.as_tensor, torch.tril_indices, torch.triu_indices,
    torch.rand, torch.randn, torch.randint, torch.randperm,
)  # fmt: skip
FACTORIES = frozenset(_FACTORY_FUNCTIONS)
"""Functions that make a tensor from Python values alone."""


class _Recorder(TorchFunctionMode):
    """Turns a call of a factory on Python values into a graph operator of `tracer`."""

    def __init__(self, tracer: fx.Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        if func in FACTORIES and not any(isinstance(leaf, fx.Proxy) for leaf in leaves):
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)


def factories_recorded(tracer: fx.Tracer, *, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    """While `tracer` traces, record factory calls on Python values (NOTE [factories while tracing])."""
    return _Recorder(tracer) if enabled else contextlib.nullcontext()
