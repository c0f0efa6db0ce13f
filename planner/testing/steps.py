"""One training step's loss, gradients and buffers, to check a changed module against the original.

Why it exists: the planner promises that `plan.module` trains as the model did (same loss, same
gradients, BatchNorm statistics updated once, dropout included), and so must the hand-written peers
the benches time. Every such check runs the same experiment: a copy of each module takes one forward
and backward on copies of the same inputs under one seed, and the results are compared. The tests,
the service tests and the benches all run it from here.

A `Variant` names its parameters and buffers as the unmodified model does, so a variant whose
module renames them (`checkpoint_wrapper` inserts a level) still lines up with the original;
`variant_of(module)` takes the module's own names, right for `plan.module`, which keeps the model's.
Gradients of the inputs that require one are recorded after the parameters' as `input <k>`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from planner.profiler.measurement import default_loss

__all__ = [
    "STEP_SEED",
    "StepRecord",
    "Variant",
    "assert_same_step",
    "buffer_mismatch",
    "copied_variant",
    "fresh_inputs",
    "fresh_kwargs",
    "gradient_error",
    "gradient_mismatch",
    "max_gradient_difference",
    "one_step",
    "record_step",
    "seeded_gradients",
    "variant_of",
    "with_run_to_run_noise",
]

STEP_SEED = 1234
"""Seed set before each compared forward, so dropout draws the same masks in every variant."""
TEST_RTOL = 1e-6
"""Default tolerance of `assert_same_step`, relative to each gradient's largest magnitude."""
NOISE_FACTOR = 2.0
"""How many times a gradient's run-to-run difference a compared gradient may differ by (NOTE
[run-to-run noise])."""


@dataclass(frozen=True)
class Variant:
    """A module and the parameters and buffers it trains, by their names in the unmodified model."""

    module: nn.Module
    parameters: Mapping[str, nn.Parameter]
    buffers: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StepRecord:
    """Loss, gradients (parameters, then inputs as `input <k>`; None where none arrived) and buffers
    after one forward and backward."""

    loss: torch.Tensor
    gradients: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    gradient_noise: dict[str, float] = field(default_factory=dict)
    """Per gradient, the largest difference between two runs of this same step (`with_run_to_run_noise`);
    empty where the step was run once."""


def with_run_to_run_noise(record: StepRecord, again: StepRecord) -> StepRecord:
    """`record` with the largest difference of each gradient from `again`, the same step run again.

    NOTE [run-to-run noise]: on a GPU some kernels accumulate in an order that changes from run to run
    (atomics in convolution and attention backward), so one model's step, run twice, gives gradients
    that differ in rounding. On an H200 diffusers' UNet2DModel differed so by 1.7e-7 to
    3.4e-7 in a `to_k.bias` whose true gradient is zero, far beyond a tolerance relative to that
    gradient's own scale, and every row of `bench.compare` failed the check, the row without checkpointing
    included. A compared gradient may therefore also differ by `NOISE_FACTOR` times the reference's
    own run-to-run difference; on the CPU, where steps repeat bitwise, that adds nothing."""
    pairs, unpaired = _paired_gradients(record, again)
    if unpaired is not None:
        raise ValueError(f"the same step run twice did not pair up: {unpaired}")
    noise = {name: (got - want).abs().max().item() for name, want, got in pairs}
    return replace(record, gradient_noise=noise)


def fresh_inputs(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Copies of the example inputs, so no variant sees another's `.grad` or in-place change."""
    return tuple(
        value.detach().clone().requires_grad_(value.requires_grad)
        if isinstance(value, torch.Tensor)
        else value
        for value in inputs
    )


def fresh_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Copies of the example keyword inputs (see `fresh_inputs`)."""
    if not kwargs:
        return {}
    return dict(zip(kwargs, fresh_inputs(tuple(kwargs.values())), strict=True))


def variant_of(module: nn.Module) -> Variant:
    """`module` with its own parameter and buffer names."""
    return Variant(
        module=module, parameters=dict(module.named_parameters()), buffers=dict(module.named_buffers())
    )


def copied_variant(variant: Variant) -> Variant:
    """A deep copy of `variant` whose parameters and buffers keep their names."""
    memo: dict[int, Any] = {}
    module = copy.deepcopy(variant.module, memo)
    return Variant(
        module=module,
        parameters={name: memo[id(parameter)] for name, parameter in variant.parameters.items()},
        buffers={name: memo[id(buffer)] for name, buffer in variant.buffers.items()},
    )


def record_step(
    variant: Variant,
    inputs: Sequence[Any],
    *,
    kwargs: Mapping[str, Any] | None = None,
    seed: int = STEP_SEED,
    forward_context: contextlib.AbstractContextManager[Any] | None = None,
) -> StepRecord:
    """Forward (inside `forward_context`, e.g. an autocast) and backward of `variant` itself (its
    gradients and buffers change) under `seed`."""
    step_inputs = fresh_inputs(inputs)
    torch.manual_seed(seed)
    with forward_context or contextlib.nullcontext():
        loss = default_loss(variant.module(*step_inputs, **fresh_kwargs(kwargs)))
    loss.backward()
    gradients = {name: parameter.grad for name, parameter in variant.parameters.items()}
    for index, value in enumerate(step_inputs):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            gradients[f"input {index}"] = value.grad
    return StepRecord(
        loss=loss.detach(),
        gradients=gradients,
        buffers={name: buffer.detach().clone() for name, buffer in variant.buffers.items()},
    )


def one_step(
    model: nn.Module | Variant,
    inputs: Sequence[Any],
    *,
    kwargs: Mapping[str, Any] | None = None,
    seed: int = STEP_SEED,
    forward_context: contextlib.AbstractContextManager[Any] | None = None,
) -> StepRecord:
    """`record_step` on a copy of `model` (a module, with its own names, or a Variant)."""
    variant = model if isinstance(model, Variant) else variant_of(model)
    return record_step(
        copied_variant(variant), inputs, kwargs=kwargs, seed=seed, forward_context=forward_context
    )


def _paired_gradients(
    expected: StepRecord, actual: StepRecord
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], str | None]:
    """(name, expected, actual) of every gradient both records have, or why they do not pair up."""
    if expected.gradients.keys() != actual.gradients.keys():
        differing = sorted(expected.gradients.keys() ^ actual.gradients.keys())
        return [], f"the same parameters must receive gradients; only one variant has {differing[:3]}"
    pairs = []
    for name, want in expected.gradients.items():
        got = actual.gradients[name]
        if want is None or got is None:
            if want is not got:
                return [], f"gradient of {name}: one variant has no gradient"
            continue
        pairs.append((name, want, got))
    return pairs, None


def gradient_mismatch(expected: StepRecord, actual: StepRecord, *, rtol: float) -> str | None:
    """Why the loss (within `rtol`) or a gradient (within `rtol` of its largest magnitude, elementwise
    also `rtol` relative) differs, or None when they match."""
    pairs, unpaired = _paired_gradients(expected, actual)
    if unpaired is not None:
        return unpaired
    checks = [("loss", actual.loss, expected.loss, 0.0)]
    checks += [
        (f"gradient of {name}", got, want, _tolerance(expected, name, want, rtol))
        for name, want, got in pairs
    ]
    for what, got, want, atol in checks:
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as error:
            return f"{what}: {str(error).splitlines()[0]}"
    return None


def _tolerance(expected: StepRecord, name: str, want: torch.Tensor, rtol: float) -> float:
    """The absolute tolerance of gradient `name`: `rtol` of its scale, or its run-to-run noise (NOTE
    [run-to-run noise])."""
    return max(rtol * (want.abs().max().item() or 1.0), NOISE_FACTOR * expected.gradient_noise.get(name, 0.0))


def max_gradient_difference(expected: StepRecord, actual: StepRecord) -> float:
    """The largest |actual - expected| of any gradient relative to that gradient's largest magnitude
    (inf when only one record has a gradient)."""
    pairs, unpaired = _paired_gradients(expected, actual)
    if unpaired is not None:
        return math.inf
    return max(((got - want).abs().max() / (want.abs().max() or 1.0)).item() for _, want, got in pairs)


def gradient_error(expected: StepRecord, actual: StepRecord) -> float:
    """||actual - expected|| / ||expected|| over all gradients at once (inf when only one has a gradient).

    One norm over the whole model, unlike `gradient_mismatch`'s per-tensor scale: a parameter whose true
    gradient is ~0 (a bias before a BatchNorm) has a per-tensor scale made of rounding noise.
    """
    pairs, unpaired = _paired_gradients(expected, actual)
    if unpaired is not None:
        return math.inf
    difference_squared = reference_squared = 0.0
    for _, want, got in pairs:
        difference_squared += (got.double() - want.double()).square().sum().item()
        reference_squared += want.double().square().sum().item()
    return (
        math.sqrt(difference_squared / reference_squared)
        if reference_squared
        else math.sqrt(difference_squared)
    )


def _close_to_scale(got: torch.Tensor, want: torch.Tensor, *, rtol: float) -> bool:
    if not want.is_floating_point():
        return torch.equal(got, want)
    scale = want.abs().max().item() or 1.0
    return torch.allclose(got, want, rtol=rtol, atol=rtol * scale)


def buffer_mismatch(expected: StepRecord, actual: StepRecord, *, rtol: float = 0.0) -> str | None:
    """Which buffers (BatchNorm statistics) differ after one step, bitwise or (with `rtol`) by more than
    `rtol` of the buffer's largest value; None when all agree."""
    if expected.buffers.keys() != actual.buffers.keys():
        return (
            f"the variants have different buffers: {sorted(expected.buffers.keys() ^ actual.buffers.keys())}"
        )
    differing = [
        name
        for name, want in expected.buffers.items()
        if not (
            torch.equal(want, actual.buffers[name])
            or (rtol > 0 and _close_to_scale(actual.buffers[name], want, rtol=rtol))
        )
    ]
    if not differing:
        return None
    return (
        f"{len(differing)} of {len(expected.buffers)} buffers differ after one step, first {differing[0]!r}"
    )


def assert_same_step(expected: StepRecord, actual: StepRecord, *, rtol: float = TEST_RTOL) -> None:
    """Assert equal loss and gradients (within `rtol`, see `gradient_mismatch`) and bitwise equal buffers."""
    mismatch = gradient_mismatch(expected, actual, rtol=rtol) or buffer_mismatch(expected, actual)
    assert mismatch is None, mismatch


def seeded_gradients(
    module: nn.Module,
    targets: Sequence[torch.Tensor],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    seed: int = STEP_SEED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and the gradients of `targets` (flattened, in order) of one step of `module` under `seed`,
    by `torch.autograd.grad`: nothing is written to `.grad`, so a compiled module stays as it was."""
    torch.manual_seed(seed)
    loss = default_loss(module(*args, **(kwargs or {})))
    gradients = torch.autograd.grad(loss, list(targets))
    return loss.detach(), torch.cat([gradient.flatten() for gradient in gradients])
