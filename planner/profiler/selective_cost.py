"""What checkpointing costs beyond the recompute: each checkpoint call's own work, and a selective policy's.

Every checkpointed region pays `torch.utils.checkpoint`'s own work once per step: saving and restoring
the RNG state, its saved-tensor hooks, setting up and running the replay. On a CPU this is a fraction of
a millisecond, as much as the forward of a small block, so ten small regions cost more than one region
that replays the same operators. `measure_checkpoint_cost` measures it on the device over the same
chain of tiny blocks, as a part per call and a part per operator (its hooks run for every tensor the
region saves); the planner charges both to every checkpointed region
(`ActivationGraph.checkpoint_call_ms`, `checkpoint_op_ms`).

NOTE [checkpoint's own work]: the per-call part is the chain checkpointed block by block less the same
chain as one region, whose replays run the same operators, so the difference is checkpoint's own work
alone; the per-operator part is one region less a plain step and its replay. Each is a median of
per-round differences over interleaved rounds. It used to come from one region of one block against one
of four, fastest round of each: that put most of the cost on the operators and varied from 0.0 to 0.12
ms a call between processes on this project's CPU, where regions inside real steps cost 0.25 to 0.38 ms
a region more than their replay (`python -m bench.region_overhead`, fitted per model on gpt_tiny, BERT
and a U-Net). Measured so, the part per call is 0.22 to 0.27 ms and per operator 0.014 to 0.019 ms over
four processes.

A checkpointed region that keeps nodes (see NOTE [selective keeps] in simulation/step.py) runs under
`create_selective_checkpoint_contexts`: a TorchDispatchMode that calls back into Python for every
operator of the region, in forward and again in the replay. On a small model that per-operator cost
is larger than the recompute the keeps save, so the planner charges it: each region with keeps pays
`ActivationGraph.selective_op_overhead_ms` for every operator its nodes dispatch (`Node.operator_count`).

The overhead is host-side Python and depends on the operator: measured on this project's CPU, an
elementwise multiplication costs 6 us in forward, a convolution 25 us in forward, replay and backward
together, a batch norm 15 us, a linear layer 12 us. So it is measured on the device over a chain of
tiny blocks of the operators training graphs are made of (convolution, batch norm, ReLU, linear,
layer norm, GELU, products), each of which saves tensors, so that the replay runs as in a real region
(a chain of multiplications by a constant saves nothing, is never replayed, and measured a quarter
of what a DenseNet's operators cost). The analytic cost model takes the device spec's estimate instead.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "CheckpointCost",
    "OperatorCounter",
    "measure_checkpoint_cost",
    "measure_selective_op_overhead_ms",
    "saved_when_kept",
]

CHAIN_BLOCKS = 4
CHANNELS, SIDE, WIDTH = 4, 4, 8
"""Tiny tensors, so that the chain's time is dispatch and callbacks rather than arithmetic."""
TIMED_ROUNDS = 9


ALIASING_OPERATORS = frozenset({torch.ops.aten._unsafe_view.default})
"""Operators whose output shares its input's storage although their schema does not say so."""

UNINITIALIZED_OPERATORS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)
"""Operators whose output is only ever filled in place afterwards (dropout's mask on the CPU)."""

CAST_OPERATORS = frozenset({torch.ops.aten._to_copy.default})
"""Dtype casts: autocast serves repeated casts of a weight from its cache in forward but not in the
replay, so a replay cannot match them one to one with cached ones; they are cheap to redo."""


def saved_when_kept(operator: Any) -> bool:
    """Whether the selective policy caches this operator's output when its node is kept.

    Views are replayed (a cached view would pin its input), and so are casts and tensors written in
    place after they are made (a composite's scratch: dropout inside `scaled_dot_product_attention` is
    `empty_like`, `bernoulli_`, `div_` on the CPU), since checkpoint refuses a cached tensor that was
    mutated after it was saved. The profiling step sizes a kept node's cache with the same test
    (`Node.keep_cache_bytes`), so the two cannot disagree.
    """
    if getattr(operator, "is_view", False) or operator in ALIASING_OPERATORS:
        return False
    schema = getattr(operator, "_schema", None)
    mutable = schema is not None and schema.is_mutable
    return not (mutable or operator in UNINITIALIZED_OPERATORS or operator in CAST_OPERATORS)


class OperatorCounter(TorchDispatchMode):
    """Counts the operators dispatched under it (each is one callback of a selective policy), and those
    that draw random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.random_count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        self.random_count += draws_random_numbers(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def draws_random_numbers(operator: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """An ATen operator tagged as seeded (dropout, bernoulli, ...); attention only with dropout_p > 0."""
    if torch.Tag.nondeterministic_seeded not in getattr(operator, "tags", ()):
        return False
    names = [argument.name for argument in operator._schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    dropout_p = args[position] if len(args) > position else kwargs.get("dropout_p", 0.0)
    return not isinstance(dropout_p, int | float) or dropout_p > 0


def _chain(x: torch.Tensor, weights: dict[str, torch.Tensor], blocks: int = CHAIN_BLOCKS) -> torch.Tensor:
    for _ in range(blocks):
        y = F.conv2d(x, weights["conv"], weights["conv_bias"], padding=1)
        y = F.batch_norm(y, None, None, weights["norm"], weights["norm_bias"], training=True)
        v = F.linear(torch.relu(y).flatten(1), weights["linear"], weights["linear_bias"])
        v = F.gelu(F.layer_norm(v, v.shape[-1:]))
        x = x + (v * v).mean()
    return x


def _chain_inputs(device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    shapes = {
        "conv": (CHANNELS, CHANNELS, 3, 3),
        "conv_bias": (CHANNELS,),
        "norm": (CHANNELS,),
        "norm_bias": (CHANNELS,),
        "linear": (WIDTH, CHANNELS * SIDE * SIDE),
        "linear_bias": (WIDTH,),
    }
    weights = {name: torch.rand(shape, device=device, requires_grad=True) for name, shape in shapes.items()}
    return torch.rand(2, CHANNELS, SIDE, SIDE, device=device, requires_grad=True), weights


def _recompute_everything(context: Any, operator: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _step_s(device: torch.device, *, selective: bool) -> float:
    x, weights = _chain_inputs(device)
    options: dict[str, Any] = {}
    if selective:
        options["context_fn"] = lambda: create_selective_checkpoint_contexts(_recompute_everything)
    _synchronize(device)
    started = time.perf_counter()
    checkpoint(_chain, x, weights, CHAIN_BLOCKS, use_reentrant=False, **options).sum().backward()
    _synchronize(device)
    return time.perf_counter() - started


def _plain_step_s(device: torch.device, *, backward: bool) -> float:
    x, weights = _chain_inputs(device)
    _synchronize(device)
    started = time.perf_counter()
    output = _chain(x, weights)
    if backward:
        output.sum().backward()
    _synchronize(device)
    return time.perf_counter() - started


@dataclass(frozen=True)
class CheckpointCost:
    """What one checkpointed region costs beyond replaying its forward, forward and backward together."""

    call_ms: float
    """Once per region: the RNG state saved and restored, the replay set up."""
    per_operator_ms: float
    """Per operator of the region: checkpoint's Python hooks on each tensor it saves and unpacks."""


def _regions_step_s(device: torch.device, regions: int) -> float:
    """Forward and backward of a chain of `CHAIN_BLOCKS` blocks cut into `regions` checkpoints of equal
    length: every cut replays the same operators, so two cuts differ by checkpoint's own work alone."""
    x, weights = _chain_inputs(device)
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(regions):
        x = checkpoint(_chain, x, weights, CHAIN_BLOCKS // regions, use_reentrant=False)
    x.sum().backward()
    _synchronize(device)
    return time.perf_counter() - started


CHAIN_TIMINGS: dict[str, Callable[[torch.device], float]] = {
    "block_regions": lambda device: _regions_step_s(device, CHAIN_BLOCKS),
    "one_region": lambda device: _regions_step_s(device, 1),
    "plain": lambda device: _plain_step_s(device, backward=True),
    "forward": lambda device: _plain_step_s(device, backward=False),
}
"""The chain's steps `measure_checkpoint_cost` times, by name (`checkpoint_cost_from` reads them)."""
PAIRED_ROUNDS = 25
"""Rounds of the chain's steps `measure_checkpoint_cost` times, one of each per round."""


def checkpoint_cost_from(timings_s: Mapping[str, Sequence[float]], *, operators: int) -> CheckpointCost:
    """NOTE [checkpoint's own work]: the per-region part from a chain checkpointed block by block less
    the same chain as one region (the same replay: `CHAIN_BLOCKS - 1` regions more), and the per-operator
    part from one region less a plain step and its replay (a forward), over the chain's `operators`;
    each a median of per-round differences, never below 0."""
    rounds = zip(*(timings_s[name] for name in CHAIN_TIMINGS), strict=True)
    by_round = [dict(zip(CHAIN_TIMINGS, values, strict=True)) for values in rounds]
    call_s = statistics.median(t["block_regions"] - t["one_region"] for t in by_round) / (CHAIN_BLOCKS - 1)
    region_s = statistics.median(t["one_region"] - t["plain"] - t["forward"] for t in by_round)
    call_s = max(0.0, call_s)
    per_operator_s = max(0.0, region_s - call_s) / operators
    return CheckpointCost(call_ms=call_s * 1e3, per_operator_ms=per_operator_s * 1e3)


@functools.cache
def measure_checkpoint_cost(device: torch.device) -> CheckpointCost:
    """Checkpoint's own time on `device` (`checkpoint_cost_from`), from `PAIRED_ROUNDS` interleaved
    rounds of the chain's steps after a warm-up. On one CPU thread (see
    `measure_selective_op_overhead_ms`); measured once per process and device."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(2):
            for timed in CHAIN_TIMINGS.values():
                timed(device)
        timings_s: dict[str, list[float]] = {name: [] for name in CHAIN_TIMINGS}
        for round_index in range(PAIRED_ROUNDS):
            names = list(CHAIN_TIMINGS)
            for name in names if round_index % 2 else reversed(names):
                timings_s[name].append(CHAIN_TIMINGS[name](device))
    finally:
        torch.set_num_threads(threads)
    return checkpoint_cost_from(timings_s, operators=_chain_operators(device))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def measure_selective_op_overhead_ms(device: torch.device) -> float:
    """Extra time per operator of a selective checkpoint over a plain one, forward, replay and backward
    of the chain: the fastest of interleaved rounds of each after a warm-up (a busy host only adds
    time). A property of the host and device, not of a model: measured once per process and device.

    The callbacks run on the calling thread, and tiny tensors give intra-op threads no work, so the
    chain runs on one CPU thread: on a busy host, waking a pool of threads for each tiny operator
    made the figure swing between 18 and 240 us."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for selective in (False, True, False, True):
            _step_s(device, selective=selective)
        plain_s, selective_s = [], []
        for _ in range(TIMED_ROUNDS):
            plain_s.append(_step_s(device, selective=False))
            selective_s.append(_step_s(device, selective=True))
    finally:
        torch.set_num_threads(threads)
    return max(0.0, min(selective_s) - min(plain_s)) * 1e3 / _chain_operators(device)


def _chain_operators(device: torch.device) -> int:
    counter = OperatorCounter()
    with counter:
        _chain(*_chain_inputs(device))
    return counter.count
