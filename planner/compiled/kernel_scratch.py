"""Scratch memory an extern kernel allocates inside one call, measured once per operator signature.

Why it exists: the joint graph of a compiled step shows each operator's inputs and outputs, and the
fusion model (fusion.py) decides which of them become buffers. An extern kernel also allocates
inside the call what no graph value shows: mkldnn's convolution reorders its weight, and its backward
copies the gradient and input into the layout it computes in. A ResNet plan predicted at 8.43 MiB
measured 8.81: three 144 KiB buffers inside one `convolution_backward` set the step's peak. Dropout
under `torch._inductor.config.fallback_random` runs aten's `native_dropout`, which draws a float mask
as large as its input before it returns the boolean one.

NOTE [kernel scratch]: the planner runs each such operator once, outside the compile's fake tensor
mode, on tensors of the shapes, strides and dtype the joint graph gives it and in the layout inductor
runs it in (channels-last for a 4-d tensor where inductor's layout optimisation is on: NOTE [layout
copies] in joint_graph.py), filled with ones (the RNG state is restored after a random operator
draws), and counts the bytes the call held above its outputs at its peak: on the CPU from the
profiler's allocator events (not while a profiler of the caller's runs: a second one would end it),
on CUDA from the allocator's peak statistic. The figure is a measurement of this machine's kernels,
as the eager planner's workspaces are (NOTE [measured residuals] in ir.py); signatures repeat across
a network, and each is measured once.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from planner.ir import MemoryCounting
from planner.profiler.counting import current_counting, storage_bytes

__all__ = ["SCRATCH_OPERATORS", "scratch_bytes"]

log = logging.getLogger(__name__)

SCRATCH_OPERATORS = frozenset(
    {torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}
    | {torch.ops.aten.native_dropout.default}
)
"""Extern operators whose calls allocate scratch memory (NOTE [kernel scratch])."""

_TensorSpec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, str]


def scratch_bytes(nodes: Iterable[fx.Node], *, channels_last: bool) -> dict[fx.Node, int]:
    """Bytes each node of `nodes` that calls a scratch operator holds above its outputs while it runs;
    the `getitem`s that unpack its outputs map to the same figure. `channels_last`: whether inductor
    runs convolutions in channels-last (its layout optimisation decided so)."""
    calls = [node for node in nodes if node.target in SCRATCH_OPERATORS]
    if torch.autograd._profiler_enabled() and any(_on_cpu(node) for node in calls):
        # a second profiler would end the caller's, and its events would be lost
        log.warning(
            "a profiler is running: the scratch memory of %d convolution calls on the CPU is not "
            "measured, and not predicted",
            sum(_on_cpu(node) for node in calls),
        )
        calls = [node for node in calls if not _on_cpu(node)]
    measured: dict[fx.Node, int] = {}
    for node in calls:
        signature = _signature(node.args, channels_last)
        if signature is not None:
            measured[node] = _measured_scratch_bytes(node.target, signature, current_counting())
    unpacked = {
        user: scratch
        for node, scratch in measured.items()
        for user in node.users
        if user.target is operator.getitem
    }
    return measured | unpacked


def _on_cpu(node: fx.Node) -> bool:
    tensors = [value for value in tree_flatten(node.meta.get("val"))[0] if isinstance(value, torch.Tensor)]
    return all(tensor.device.type == "cpu" for tensor in tensors)


def _signature(args: tuple[Any, ...], channels_last: bool) -> tuple[Any, ...] | None:
    """`args` with each graph value replaced by the spec of a tensor like it (hashable), or None where
    a value is not a tensor with static sizes, or a size is symbolic."""
    specs: list[Any] = []
    for arg in args:
        if isinstance(arg, list) and any(isinstance(item, fx.Node) for item in arg):
            return None
        if not isinstance(arg, fx.Node):
            specs.append(tuple(arg) if isinstance(arg, list) else arg)
            continue
        value = arg.meta.get("val")
        if not isinstance(value, torch.Tensor) or not _static(value):
            return None
        layout_stride = (
            _channels_last_stride(_sliced_from(arg)) if channels_last and value.dim() == 4 else value.stride()
        )
        specs.append((tuple(value.shape), tuple(layout_stride), value.dtype, str(value.device)))
    return tuple(specs)


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(size, int) for size in (*value.shape, *value.stride()))


def _sliced_from(node: fx.Node) -> torch.Tensor:
    """The value whose memory `node`'s value is, through slices of step 1, which keep their base's
    strides (NOTE [sliced arguments]).

    NOTE [sliced arguments]: the gradient of a skip connection concatenated along channels reaches
    each branch as a slice of the concatenation's gradient. In channels-last its strides are the whole
    concatenation's, and mkldnn's `convolution_backward` copies such an argument into a dense one
    before it computes: the zoo's U-Net, whose transposed convolution's output is concatenated with
    a skip connection, held a 256 KiB copy inside that backward which a dense probe did not hold, and
    a plan setting its peak there measured 114 KiB (2.7 %) above its prediction."""
    while node.target is torch.ops.aten.slice.Tensor and (len(node.args) < 5 or node.args[4] == 1):
        source = node.args[0]
        if not isinstance(source, fx.Node):
            break
        value = source.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() != 4:
            break
        node = source
    return cast(torch.Tensor, node.meta["val"])


def _channels_last_stride(value: torch.Tensor) -> tuple[int, ...]:
    _, channels, height, width = value.shape
    return (channels * height * width, 1, width * channels, channels)


@functools.lru_cache(maxsize=1024)
def _measured_scratch_bytes(
    target: Callable[..., Any], signature: tuple[Any, ...], counting: MemoryCounting
) -> int:
    device = next(torch.device(spec[3]) for spec in signature if _is_tensor_spec(spec))
    forked = [device] if device.type == "cuda" else []
    with torch.no_grad(), _disable_current_modes(), torch.random.fork_rng(forked, device_type=device.type):
        args = [_ones(spec) if _is_tensor_spec(spec) else _as_argument(spec) for spec in signature]
        if device.type == "cuda":
            return _cuda_scratch_bytes(target, args, device, counting)
        return _cpu_scratch_bytes(target, args, counting)


def _is_tensor_spec(spec: Any) -> bool:
    return isinstance(spec, tuple) and len(spec) == 4 and isinstance(spec[2], torch.dtype)


def _as_argument(spec: Any) -> Any:
    return list(spec) if isinstance(spec, tuple) else spec


def _ones(spec: _TensorSpec) -> torch.Tensor:
    shape, stride, dtype, device = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(1)


def _output_bytes(output: Any, counting: MemoryCounting) -> int:
    tensors = [value for value in tree_flatten(output)[0] if isinstance(value, torch.Tensor)]
    return storage_bytes(tensors, counting)


def _cpu_scratch_bytes(target: Callable[..., Any], args: list[Any], counting: MemoryCounting) -> int:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        output = target(*args)
    events = sorted(profile.profiler.kineto_results.events(), key=lambda event: event.start_ns())
    live_bytes = peak_bytes = 0
    for event in events:
        if event.name() == "[memory]":
            size_bytes = counting.of(abs(event.nbytes()))
            live_bytes += size_bytes if event.nbytes() > 0 else -size_bytes
            peak_bytes = max(peak_bytes, live_bytes)
    return max(0, peak_bytes - _output_bytes(output, counting))


def _cuda_scratch_bytes(
    target: Callable[..., Any], args: list[Any], device: torch.device, counting: MemoryCounting
) -> int:
    """The allocator's own statistics: allocated bytes are 512-byte blocks, requested bytes exact."""
    stat = "allocated_bytes.all" if counting is MemoryCounting.BLOCKS else "requested_bytes.all"
    torch.cuda.synchronize(device)
    before_bytes = torch.cuda.memory_stats(device)[f"{stat}.current"]
    torch.cuda.reset_peak_memory_stats(device)
    output = target(*args)
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.memory_stats(device)[f"{stat}.peak"] - before_bytes
    return max(0, peak_bytes - _output_bytes(output, counting))
