"""What a trace would change about training, and so is kept whole: custom autograd Functions, grad
mode switched inside a forward, hooks a forward registers on tensors, and tensors it stores on a module.

Why it exists: a captured graph holds operators, and autograd differentiates them as it finds them
when the planned module runs. Four things a forward does are not operators, and a trace drops them:

NOTE [custom autograd functions]: a `torch.autograd.Function` carries a backward of its own (a gradient
reversal, a straight-through estimator, a fused kernel's hand-written gradient). `torch.fx` traces its
`forward` like any Python code, and `torch.export` records its forward's ATen operators; either way the
graph keeps the forward and autograd differentiates it, so the custom backward is gone. A model that
reversed the gradient between two Linears (`forward` returns `x.view_as(x)`, `backward` returns
`-grad`) was captured by FX as the view, and `plan.module` trained its first Linear with the opposite
gradient, with no checkpointing at all; a `torch.export` of it did the same.

NOTE [grad mode while tracing]: `with torch.no_grad():` (or `torch.set_grad_enabled`, `@torch.no_grad()`
on a helper) switches autograd off for the operators inside. FX records the operators, not the switch,
so in `plan.module` gradients flowed through a scale a model computed under `no_grad` and its first
Linear trained otherwise. So with `torch.autocast` entered in a forward (`enabled=False` to compute a
loss head in float32): under the training step's autocast, the traced head ran in bfloat16 and returned
another dtype. `torch.export` records both switches (`wrap_with_set_grad_enabled`,
`wrap_with_autocast`), so only FX is refused them.

NOTE [tensor hooks]: a hook a forward registers on a tensor (`hidden.register_hook(lambda g: g * 0.5)`:
a gradient scaled or clipped per activation) changes the gradient that flows back through it. Export
ran the registration on its fake tensor and kept no trace of it, and `plan.module` trained without the
hook; FX cannot record it either.

NOTE [stored on the module]: a forward that stores a tensor on its module (`self.aux_loss = ...`, a
mixture of experts' load-balancing loss the training loop adds to its loss; `self.last_attention = ...`
for logging) does so once, at the trace, with the trace's value: FX left an `fx.Proxy` on the user's
module, and `plan.module` never set it again, so a loss read from it missed its gradient. Each trace
(`stored_during`) restores what it stored, and the module that stored it is kept whole: FX keeps it
opaque, export refuses it (a root goes on to the module level).

NOTE [Python draws]: a forward that draws from Python's `random` or NumPy's (`if random.random() <
self.layerdrop: continue`, a scale from `random.uniform`) draws while tracing, and the graph keeps the
value drawn: a four-layer stack with LayerDrop 0.5 drawn by `random.random()` was captured by FX without
two of its layers, and `plan.module` gave one loss where the model gave six. While the chain traces,
those functions raise, and a draw that reached the global generators some other way (a function bound
before, as `from random import random`) changes their state, which the trace's end checks for the
generators loaded when the trace began: the first export of a process imports `numpy.random` itself,
and counting that generator as changed refused every model torch and the planner alone had loaded (a
model exported in a fresh process, as a user's first `optimize` is, was kept whole or refused).

While the chain traces (`refused_while_tracing`, and `refuse_traced_call` for what FX records), each
raises `ChangesTraining`: FX keeps the submodule whose forward does it as one opaque node, called as
written, and a root that does it goes on to export; export fails where a custom Function is applied or
a tensor hook registered, so a container stays opaque and a root goes on to the module level. Such a
module is then checkpointed whole or not at all; one that draws from Python's or NumPy's generator is
split at its children only where they are not called at random (`static_split_calls`), and its
checkpoint replays its draws (NOTE [Python draws replayed] in rewrite/emit.py).
"""

from __future__ import annotations

import contextlib
import random
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

__all__ = [
    "ChangesTraining",
    "drawing_generators",
    "drawing_generators_restored",
    "generator_states",
    "refuse_traced_call",
    "refused_while_tracing",
    "set_drawing_generators",
    "stored_during",
]

PYTHON_DRAWS = (
    "random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle", "gauss",
    "normalvariate", "lognormvariate", "expovariate", "betavariate", "gammavariate", "triangular",
    "vonmisesvariate", "paretovariate", "weibullvariate", "getrandbits",
)  # fmt: skip
"""Functions of Python's `random` module that draw from its global generator (NOTE [Python draws])."""
NUMPY_DRAWS = (
    "random", "rand", "randn", "randint", "uniform", "normal", "choice", "permutation", "shuffle",
    "random_sample", "standard_normal", "binomial",
)  # fmt: skip
"""Functions of `numpy.random` that draw from its global generator (NOTE [Python draws])."""
TENSOR_HOOKS = ("register_hook", "register_post_accumulate_grad_hook")
"""Tensor methods that register a hook on the gradient (NOTE [tensor hooks])."""


class ChangesTraining(RuntimeError):
    """A traced forward did what a captured graph would not reproduce (see the module docstring)."""


def refuse_traced_call(kind: str, target: object) -> None:
    """Raise `ChangesTraining` for a call FX is about to record that registers a tensor hook."""
    if kind == "call_method" and target in TENSOR_HOOKS:
        raise ChangesTraining(_hook_refusal(str(target)))


def _hook_refusal(method: str) -> str:
    return (
        f"the forward calls {method} on a tensor: a trace would not keep the hook, so the module doing "
        "it is planned whole (NOTE [tensor hooks])"
    )


@contextlib.contextmanager
def refused_while_tracing(*, fake_tensors: bool) -> Iterator[None]:
    """Raise `ChangesTraining` where a custom autograd Function is applied to an FX Proxy, or with
    `fake_tensors` (torch.export traces with them) to any tensor, where a tensor hook is registered
    then too; without it (FX), where grad mode is switched or an autocast entered (NOTE [grad mode while
    tracing]); and where the forward draws from Python's or NumPy's generators (NOTE [Python draws])."""
    apply = torch.autograd.Function.__dict__["apply"]
    hooks = {method: getattr(torch.Tensor, method) for method in TENSOR_HOOKS}
    set_grad_enabled = torch._C._set_grad_enabled
    enter_autocast = torch.autocast.__enter__
    traced = (fx.Proxy, torch.Tensor) if fake_tensors else (fx.Proxy,)

    def refused_apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(leaf, traced) for leaf in tree_flatten((args, kwargs))[0]):
            raise ChangesTraining(
                f"{cls.__qualname__} is a custom autograd Function: a trace would keep its forward and "
                "lose its backward, so the module applying it is planned whole (NOTE [custom autograd "
                "functions])"
            )
        return apply.__func__(cls, *args, **kwargs)

    def refused_switch(enabled: bool) -> None:
        if bool(enabled) != torch.is_grad_enabled():
            raise ChangesTraining(
                f"the forward sets grad mode to {bool(enabled)}: FX would record the operators, not the "
                "switch, so the module doing it is planned whole (NOTE [grad mode while tracing])"
            )
        set_grad_enabled(enabled)

    def refused_autocast(self: torch.autocast) -> None:
        raise ChangesTraining(
            "the forward enters torch.autocast: FX would record the operators, not the autocast, so the "
            "module doing it is planned whole (NOTE [grad mode while tracing])"
        )

    def refused_hook(method: str) -> Any:
        def register(*args: Any, **kwargs: Any) -> Any:
            raise ChangesTraining(_hook_refusal(method))

        return register

    torch.autograd.Function.apply = classmethod(refused_apply)  # type: ignore[assignment, method-assign]
    if fake_tensors:
        for method in TENSOR_HOOKS:
            setattr(torch.Tensor, method, refused_hook(method))
    else:
        torch._C._set_grad_enabled = refused_switch
        torch.autocast.__enter__ = refused_autocast  # type: ignore[method-assign, assignment]
    try:
        with _PythonDrawsRefused():
            yield
    finally:
        torch.autograd.Function.apply = apply  # type: ignore[method-assign]
        torch._C._set_grad_enabled = set_grad_enabled
        torch.autocast.__enter__ = enter_autocast  # type: ignore[method-assign]
        for method, original in hooks.items():
            setattr(torch.Tensor, method, original)


class _PythonDrawsRefused(contextlib.AbstractContextManager[None]):
    """Python's and NumPy's global draws refused while a trace runs, and their generators' states checked
    at its end (NOTE [Python draws])."""

    def __enter__(self) -> None:
        self.patched: list[tuple[Any, str, Any]] = []
        for module, names in _draw_modules():
            for name in names:
                if hasattr(module, name):
                    self.patched.append((module, name, getattr(module, name)))
                    setattr(module, name, _refused_draw(f"{module.__name__}.{name}"))
        self.states = generator_states()

    def __exit__(self, *exception: object) -> None:
        for module, name, original in self.patched:
            setattr(module, name, original)
        after = generator_states()
        if exception[0] is None and any(after[name] != state for name, state in self.states.items()):
            raise ChangesTraining(
                "the forward draws from Python's or NumPy's global random generator: a trace would make "
                "the draw once and keep its value, so the module drawing it is planned whole (NOTE [Python "
                "draws])"
            )


def _draw_modules() -> list[tuple[Any, tuple[str, ...]]]:
    """`random`, and `numpy.random` where NumPy is loaded, each with its drawing functions."""
    found: list[tuple[Any, tuple[str, ...]]] = [(random, PYTHON_DRAWS)]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        found.append((numpy_random, NUMPY_DRAWS))
    return found


def drawing_generators() -> dict[str, Any]:
    """The states of Python's global generator and, where NumPy is loaded, of NumPy's, by module name,
    as `set_drawing_generators` sets them back."""
    states: dict[str, Any] = {"random": random.getstate()}
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        states["numpy.random"] = numpy_random.get_state()
    return states


def set_drawing_generators(states: dict[str, Any]) -> None:
    """Set the generators back to `states` (from `drawing_generators`)."""
    random.setstate(states["random"])
    if "numpy.random" in states:
        sys.modules["numpy.random"].set_state(states["numpy.random"])


@contextlib.contextmanager
def drawing_generators_restored() -> Iterator[None]:
    """Python's and NumPy's generators set back after the block, as `torch.random.fork_rng` does torch's."""
    states = drawing_generators()
    try:
        yield
    finally:
        set_drawing_generators(states)


def generator_states() -> dict[str, Any]:
    """`drawing_generators`, comparable with `==`: a call that changes them drew from Python or NumPy."""
    states = drawing_generators()
    if "numpy.random" in states:
        kind, keys, position, has_gauss, cached = states["numpy.random"]
        states["numpy.random"] = (kind, keys.tobytes(), position, has_gauss, cached)
    return states


def _refused_draw(name: str) -> Any:
    def draw(*args: Any, **kwargs: Any) -> Any:
        raise ChangesTraining(
            f"the forward draws {name}(): a trace would make the draw once and keep its value (a layer "
            "LayerDrop skipped would be skipped for good), so the module drawing it is planned whole "
            "(NOTE [Python draws])"
        )

    return draw


_Attributes = dict[str, tuple[torch.nn.Module, dict[str, Any]]]


class StoredValues:
    """The modules whose forward stored a traced value on them during a trace, by qualified name, after
    what they held before was put back (NOTE [stored on the module])."""

    def __init__(self) -> None:
        self.modules: list[str] = []


@contextlib.contextmanager
def stored_during(model: torch.nn.Module) -> Iterator[StoredValues]:
    """Note every plain attribute and buffer of `model`'s modules; after the block, put back any the
    block rebound to a value holding an FX Proxy, and list the modules that held them. torch.export
    puts such attributes back itself and warns that it did: those warnings list their modules too."""
    before = _attributes(model)
    stored = StoredValues()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield stored
        finally:
            stored.modules = _restored(before)
    for warning in caught:
        assigned = EXPORT_ASSIGNMENT.search(str(warning.message))
        if assigned is None:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            continue
        for path in assigned.group(1).split(", "):
            stored.modules.append(path.removeprefix("self.").rpartition(".")[0])


EXPORT_ASSIGNMENT = re.compile(r"The tensor attributes? (.+?) (?:was|were) assigned during export")
"""torch.export's warning that a forward assigned tensor attributes, which it put back
(torch/_functorch/_aot_autograd/frontend_utils.py, `_detect_attribute_assignment`)."""


def _attributes(model: torch.nn.Module) -> _Attributes:
    return {name: (module, _held_by(module)) for name, module in model.named_modules()}


def _held_by(module: torch.nn.Module) -> dict[str, Any]:
    """The module's plain attributes, and its buffers as "buffer:<name>"."""
    return {**module.__dict__, **{f"buffer:{key}": value for key, value in module._buffers.items()}}


def _holds_proxy(value: Any) -> bool:
    """Whether `value` holds an FX Proxy: a traced value (the real tensors FX stores on the root are the
    graph's constants, which it fetches from there)."""
    return any(isinstance(leaf, fx.Proxy) for leaf in tree_flatten(value)[0])


def _restored(before: _Attributes) -> list[str]:
    changed = []
    for name, (module, held) in before.items():
        now = _held_by(module)
        rebound = [
            key for key, value in now.items() if value is not held.get(key, _MISSING) and _holds_proxy(value)
        ]
        for key in rebound:
            attributes = module._buffers if key.startswith("buffer:") else module.__dict__
            plain = key.removeprefix("buffer:")
            if key in held:
                attributes[plain] = held[key]
            else:
                del attributes[plain]
        if rebound:
            changed.append(name)
    return changed


_MISSING = object()
