"""What the benchmarks compare against: the checkpointing users write by hand, and fair ways to time it.

Why it exists: bench/fidelity.py and bench/compare.py both set our plans beside the same peers and
must check and time them the same way. The peers themselves are the hand methods of
planner/testing/hand_methods.py, which the tests run too:

- "sqrt(n) segments": what `torch.utils.checkpoint.checkpoint_sequential` does (sqrt(n) equal segments,
  all but the last checkpointed), on the model's Sequential or ModuleList of blocks;
- "every block": each child of the block container under its own non-reentrant `checkpoint_wrapper`;
- "own switch": the library's own switch where the model has one (Hugging Face's
  `gradient_checkpointing_enable`, timm's `set_grad_checkpointing`, diffusers'
  `enable_gradient_checkpointing`).

Each peer is built on a deep copy (a `Variant`, planner/testing/steps.py, which compares its loss,
gradients and buffers with the unmodified model's after one step under one seed, dropout included;
`GRADIENT_RTOL` is the benches' tolerance there), and training steps are timed in
interleaved rounds (`interleaved_step_ms`) so that drift in the machine's speed hits every variant
alike. A model's example call is `model(*inputs, **kwargs)`; `kwargs` may be omitted.

NOTE [timing noise]: on this project's 2-core virtual machine the speed of a fixed workload drifts over
seconds (a 100 ms matrix-multiply loop measured 74-114 ms between its 5th and 95th percentiles), while
two steps run back to back differ by about 4 %, whatever their length (the ratio of adjacent samples of
18 ms and of 900 ms spread alike; of 3.6 s, more). So a timing sample is one training step, the
variants run adjacent in each round, a step-time ratio is taken within a round and summarised by the
median over rounds, and precision comes from many rounds, not long samples: `interleaved_step_ms` runs
as many as fit a time budget, and `median_interval` gives the median's distribution-free 95 % interval,
which is what a verdict of "slower" is read from.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.profiler.measurement import default_loss
from planner.testing.steps import fresh_inputs, fresh_kwargs

__all__ = [
    "GRADIENT_RTOL",
    "MIB",
    "Contender",
    "contender",
    "fmt",
    "interleaved_step_ms",
    "median_interval",
    "machine",
    "mib",
    "paired_ratio",
    "planner_revision",
    "yes_no",
]

WARMUP_STEPS = 2
MEDIAN_CONFIDENCE = 0.95
"""Confidence of `median_interval`, the interval step-time verdicts are read from."""
GRADIENT_RTOL = 1e-5
MIB = 2**20


@dataclass
class Contender:
    """One variant being timed: its module, Adam optimizer and inputs."""

    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    step_ms: list[float] = field(default_factory=list)


def contender(
    name: str,
    module: nn.Module,
    inputs: Sequence[Any],
    *,
    kwargs: Mapping[str, Any] | None = None,
    copy_module: bool = True,
) -> Contender:
    """A Contender on a deep copy of `module`, or on `module` itself (a compiled module keeps its code)."""
    timed = copy.deepcopy(module) if copy_module else module
    # The same optimizer `planner.measure` builds for optimizer="adam".
    optimizer = torch.optim.Adam([p for p in timed.parameters() if p.requires_grad], lr=1e-3)
    return Contender(
        name=name, module=timed, optimizer=optimizer, inputs=fresh_inputs(inputs), kwargs=fresh_kwargs(kwargs)
    )


def training_step_ms(runner: Contender) -> float:
    """One training step as `planner.measure` runs it: zero_grad, forward, default loss, backward, Adam."""
    started_s = time.perf_counter()
    runner.optimizer.zero_grad(set_to_none=True)
    for value in (*runner.inputs, *runner.kwargs.values()):
        if isinstance(value, torch.Tensor):
            value.grad = None
    loss = default_loss(runner.module(*runner.inputs, **runner.kwargs))
    loss.backward()
    runner.optimizer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started_s) * 1e3


def round_order(runners: Sequence[Contender], round_index: int) -> list[Contender]:
    """Round `round_index`'s order: the runners rotated by the round, reversed on every other pass, so
    each runner takes every position and follows different neighbours (n! orders would not fit)."""
    shift = round_index % len(runners)
    rotated = [*runners[shift:], *runners[:shift]]
    return rotated[::-1] if (round_index // len(runners)) % 2 else rotated


def interleaved_step_ms(
    runners: Sequence[Contender],
    *,
    rounds: int,
    warmup_steps: int = WARMUP_STEPS,
    timing_s: float = 0.0,
    max_rounds: int | None = None,
) -> int:
    """Warm up each runner, then time rounds of one step each, in a different order each round; returns
    the rounds timed: `rounds`, and more while the rounds so far took less than `timing_s` seconds (at
    most `max_rounds`; NOTE [timing noise])."""
    for runner in runners:
        for _ in range(warmup_steps):
            training_step_ms(runner)
    limit = max(rounds, max_rounds or rounds)
    started_s = time.perf_counter()
    timed = 0
    while timed < rounds or (timed < limit and time.perf_counter() - started_s < timing_s):
        for runner in round_order(runners, timed):
            runner.step_ms.append(training_step_ms(runner))
        timed += 1
    return timed


def paired_ratio(numerator: Contender, denominator: Contender) -> float:
    """Median over rounds of the per-round step-time ratio (robust to drift between rounds)."""
    return statistics.median(a / b for a, b in zip(numerator.step_ms, denominator.step_ms, strict=True))


def median_interval(
    values: Sequence[float], confidence: float = MEDIAN_CONFIDENCE
) -> tuple[float, float] | None:
    """A distribution-free `confidence` interval for the median of `values`: the order statistics
    x(k) and x(n+1-k) with the largest k such that P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2.
    None for too few values to give one (n < 6 at 95 %)."""
    ordered = sorted(values)
    count = len(ordered)
    tail = (1.0 - confidence) / 2
    below = 0.0
    k = 0
    while k < count // 2:
        below += math.comb(count, k) / 2**count
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[count - k]


def mib(size_bytes: int | None) -> str:
    return "—" if size_bytes is None else f"{size_bytes / MIB:.2f}"


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def yes_no(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average_1_5_15_min": list(os.getloadavg()),
    }


def planner_revision() -> dict[str, Any]:
    """The commit and uncommitted files of the checkout being measured (the package changes often)."""
    repository = Path(__file__).resolve().parent.parent

    def git(*arguments: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *arguments], cwd=repository, capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return done.stdout.rstrip()

    status = git("status", "--porcelain", "--", "planner")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted": status.splitlines() if status else []}
