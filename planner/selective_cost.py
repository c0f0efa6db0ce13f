"""What a selective checkpoint policy costs beyond the recompute it saves.

A checkpointed region that keeps nodes (see NOTE [selective keeps] in simulate.py) runs under
`create_selective_checkpoint_contexts`: a TorchDispatchMode that calls back into Python for every
operator of the region, in forward and again in the replay. On a small model that per-operator cost
is larger than the recompute the keeps save, so the planner charges it: each region with keeps pays
`ActivationGraph.selective_op_overhead_ms` for every operator its nodes dispatch (`Node.operator_count`).

The overhead is host-side Python, so it is measured here on the model's device by timing a chain of
tiny operators under a plain checkpoint and under a selective one; the analytic cost model takes the
device spec's estimate instead.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["OperatorCounter", "measure_selective_op_overhead_ms"]

CHAIN_OPERATORS = 100
TIMED_ROUNDS = 9


class OperatorCounter(TorchDispatchMode):
    """Counts the operators dispatched under it (each is one callback of a selective policy)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN_OPERATORS):
        x = x * 1.0001
    return x


def _recompute_everything(context: Any, operator: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _step_s(device: torch.device, *, selective: bool) -> float:
    x = torch.ones(16, device=device, requires_grad=True)
    options: dict[str, Any] = {}
    if selective:
        options["context_fn"] = lambda: create_selective_checkpoint_contexts(_recompute_everything)
    _synchronize(device)
    started = time.perf_counter()
    checkpoint(_chain, x, use_reentrant=False, **options).sum().backward()
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def measure_selective_op_overhead_ms(device: torch.device) -> float:
    """Median extra time per operator of a selective checkpoint over a plain one (forward, replay
    and backward of a chain of tiny operators, interleaved rounds after a warm-up). A property of the
    host and device, not of a model: measured once per process and device."""
    for selective in (False, True, False, True):
        _step_s(device, selective=selective)
    extra_s = []
    for _ in range(TIMED_ROUNDS):
        plain_s = _step_s(device, selective=False)
        extra_s.append(_step_s(device, selective=True) - plain_s)
    return max(0.0, statistics.median(extra_s)) * 1e3 / CHAIN_OPERATORS
