"""What the benchmarks compare against: the checkpointing users write by hand, and fair ways to time it.

Why it exists: bench/fidelity.py and bench/compare.py both set our plans beside the same two peers and
must build, check and time them the same way, so the peers live here once:

- "sqrt(n) segments": what `torch.utils.checkpoint.checkpoint_sequential` does (sqrt(n) equal segments,
  all but the last checkpointed), on the model's Sequential or ModuleList of blocks;
- "every block": what `gradient_checkpointing_enable` does: each block under its own non-reentrant
  checkpoint (Hugging Face's own switch on a Hugging Face model, `checkpoint_wrapper` elsewhere).

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
import itertools
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint_sequential

from planner.profiler.measurement import default_loss
from planner.report.blocks import longest_block_stack
from planner.testing.steps import Variant, fresh_inputs, fresh_kwargs, variant_of

__all__ = [
    "EVERY_BLOCK",
    "GRADIENT_RTOL",
    "MIB",
    "SQRT_SEGMENTS",
    "BlockContainer",
    "Contender",
    "contender",
    "every_block_peer",
    "find_block_container",
    "fmt",
    "interleaved_step_ms",
    "median_interval",
    "machine",
    "mib",
    "paired_ratio",
    "planner_revision",
    "sqrt_segments_peer",
    "yes_no",
]

WARMUP_STEPS = 2
MEDIAN_CONFIDENCE = 0.95
"""Confidence of `median_interval`, the interval step-time verdicts are read from."""
GRADIENT_RTOL = 1e-5
MIN_CONTAINER_CHILDREN = 3
MIB = 2**20
SQRT_SEGMENTS = "sqrt(n) segments"
EVERY_BLOCK = "every block"
NO_REENTRANT = {"use_reentrant": False}


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
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            probe(*fresh_inputs(inputs), **fresh_kwargs(kwargs))
    finally:
        for handle in handles:
            handle.remove()
    called = tuple(name for name, _, _ in calls)
    if called != container.child_names:
        return f"the forward calls the blocks as {list(called)}, not once each in order"
    for (_, _, previous_output), (name, args, _) in itertools.pairwise(calls):
        if len(args) != 1 or args[0] is not previous_output:
            return f"block {name!r} does not take the previous block's output alone (ops run between blocks)"
    return None


class CheckpointedSequential(nn.Module):
    """An nn.Sequential run by `checkpoint_sequential`: `segments` segments, all but the last checkpointed."""

    def __init__(self, sequential: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.sequential = sequential
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.sequential, self.segments, x, use_reentrant=False)


def sqrt_segments(block_count: int) -> int:
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


def sqrt_segments_peer(
    model: nn.Module, inputs: Sequence[Any], *, kwargs: Mapping[str, Any] | None = None
) -> tuple[Variant | None, str]:
    """The "sqrt(n) segments" peer on a deep copy, or None and the reason it does not apply."""
    container = find_block_container(model)
    block_count = len(container.child_names)
    segments = sqrt_segments(block_count)
    where = f"{container.kind} {container.path or '<root>'} ({block_count} blocks, {segments} segments)"
    if container.kind == "root children":
        return None, (
            f"{type(model).__name__} has no Sequential/ModuleList of >= {MIN_CONTAINER_CHILDREN} blocks; its "
            f"forward calls {list(container.child_names)} by name, so grouping them needs a rewritten forward"
        )
    if container.kind == "ModuleList":
        violation = chain_violation(model, container, inputs, kwargs=kwargs)
        if violation is not None:
            return None, f"{where}: {violation}"
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
    return Variant(module=module, parameters=variant.parameters, buffers=variant.buffers), description


def hugging_face_peer(model: nn.Module) -> tuple[Variant, str] | None:
    """Hugging Face's own switch on a copy of a model that supports it, else None.

    transformers 5 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable` (the old
    name still works, with a warning); either checkpoints every decoder/encoder layer.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    variant = variant_of(copy.deepcopy(model))
    switch = "activation_checkpointing"
    if not hasattr(variant.module, f"{switch}_enable"):
        switch = "gradient_checkpointing"
    getattr(variant.module, f"{switch}_enable")(**{f"{switch}_kwargs": NO_REENTRANT})
    return variant, f"Hugging Face {switch}_enable(use_reentrant=False): every layer"


def every_block_peer(model: nn.Module) -> tuple[Variant, str]:
    """The "every block" peer: Hugging Face's switch, else each child of the block container wrapped by
    `checkpoint_wrapper`."""
    hugging_face = hugging_face_peer(model)
    if hugging_face is not None:
        return hugging_face
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
    return variant, description


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
