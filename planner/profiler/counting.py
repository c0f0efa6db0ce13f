"""How the planner counts bytes of memory on the machine it runs on: in which counting, the storages
behind given tensors, the live storages while a step runs, and the CPU allocator's own events.

Why it exists: every instrument of the profiler, the compiled step and the measurement counts bytes,
and a graph must count all of them one way (NOTE [counting scope]); these instruments are one idea,
apart from running and timing a training step, which measurement.py does with them (split from
measurement.py, issue 36).

On the CPU there is no allocator statistic, and RSS counts the Python heap, freed-but-cached pages and
libraries, so it is not a memory measurement. Instead `LiveStorageTracker` counts the bytes of live
tensor storages: a TorchDispatchMode sees every tensor an operator creates (forward, backward and
optimizer alike), registers its storage once, and a weakref finalizer subtracts it when the storage is
freed. Views share a storage and count once. This is the quantity `torch.cuda.memory_allocated`
reports on a GPU when each storage is counted in 512-byte blocks (NOTE [counted bytes] in ir.py): the
tracker counts both, blocks (`live_bytes`, in the counting it was made with) and exact bytes
(`exact_live_bytes`). A `torch.compile`d step is counted from the allocator's events instead
(`AllocatorPhases`, NOTE [compiled steps] in measurement.py).

NOTE [counting scope]: a graph counts every byte one way (`ActivationGraph.memory_counting`), and the
profiling step that builds it runs many instruments (the node tracker, optimizer probes, kernel scratch
probes, the compiled step's storages). `counting_scope(counting)` sets the counting they all use for the
duration of one build; outside a scope it is the default, blocks.

NOTE [wrapper subclasses]: a tensor parallel model's parameters are DTensors (and a collective's result
an AsyncCollectiveTensor until it is waited on): tensor subclasses made by `_make_wrapper_subclass`
that hold a plain tensor, this rank's shard, inside (`__tensor_flatten__` names it: `_local_tensor`,
`elem`). The wrapper's own `untyped_storage()` is a stand-in with no memory behind it, sized for the
*global* shape (a [128, 128] weight sharded in two reports 65,536 bytes and its local shard holds
32,768), and every wrapper has its own, so counting wrappers counted each shard at the whole tensor's
size and each view of it again. What a device holds is the plain tensors inside, and the counting
instruments look through wrappers to them (`local_tensors`, `storage_of`). A dispatch mode sees a
DTensor operator's result, not the local operator DTensor runs for it (modes run before subclasses,
and a mode is off inside its own handler), so what the tracker sees of a DTensor operator is its local
result; the collectives tensor parallelism runs (`_c10d_functional.all_reduce` and its wait) run on
plain tensors and are seen as they are. tests/planner/test_tensor_parallel.py checks that each rank
counts its parameters as their shards; bench/tensor_parallel.py records beside every rank's measured
peak the CPU allocator's own count, which also sees gloo's buffers (no tensor of the step).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from planner.ir import MemoryCounting

__all__ = [
    "AllocatorPhases",
    "LiveStorageTracker",
    "counted_bytes",
    "counting_scope",
    "current_counting",
    "local_tensors",
    "storage_of",
    "storage_bytes",
    "tensors_in",
]

_COUNTING: ContextVar[MemoryCounting] = ContextVar("planner_memory_counting", default=MemoryCounting.BLOCKS)


@contextmanager
def counting_scope(counting: MemoryCounting) -> Iterator[None]:
    """Count storages as `counting` says in every instrument made inside (NOTE [counting scope])."""
    token = _COUNTING.set(MemoryCounting(counting))
    try:
        yield
    finally:
        _COUNTING.reset(token)


def current_counting() -> MemoryCounting:
    """The counting of the innermost `counting_scope`, blocks outside any."""
    return _COUNTING.get()


def counted_bytes(size_bytes: int) -> int:
    """`size_bytes` of one storage or allocation, as the current counting counts it."""
    return _COUNTING.get().of(size_bytes)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists, dicts, pytree nodes (Hugging Face's
    `ModelOutput`) and dataclasses (which pytree does not open unless registered)."""
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += tensors_in([getattr(leaf, field.name) for field in dataclasses.fields(leaf)])
    return found


def local_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `tensor`'s memory on this device: `tensor` itself, or the tensors
    inside a wrapper subclass (a DTensor's local shard), looked into recursively (NOTE [wrapper
    subclasses])."""
    wrapper: Any = tensor  # the TypeGuard's protocol does not overlap Tensor for mypy
    if not is_traceable_wrapper_subclass(wrapper):
        return [tensor]
    names, _ = wrapper.__tensor_flatten__()
    # Not every inner attribute is a tensor: a DTensor also names its DeviceMesh (an opaque object).
    inner = [getattr(wrapper, name) for name in names]
    return [local for value in inner if isinstance(value, torch.Tensor) for local in local_tensors(value)]


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind `tensor` on this device: its own, or a wrapper's one inner tensor's (NOTE
    [wrapper subclasses]). A wrapper of several tensors has no one storage: that is an error."""
    inner = local_tensors(tensor)
    if len(inner) != 1:
        raise TypeError(
            f"a {type(tensor).__name__} holds {len(inner)} tensors, not one: the planner counts a tensor "
            "subclass by the one plain tensor inside it (a DTensor's local shard)"
        )
    return inner[0].untyped_storage()


class LiveStorageTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes and their peak while active (CPU or any device).

    Storages created before the tracker is entered are invisible unless passed to `track`; register
    parameters, buffers, inputs and optimizer state that way. `live_bytes` and `peak_bytes` count each
    storage as `counting` says (the current scope's by default); `exact_live_bytes` and
    `exact_peak_bytes` count its own bytes.
    """

    def __init__(self, counting: MemoryCounting | None = None) -> None:
        super().__init__()
        self.counting = current_counting() if counting is None else MemoryCounting(counting)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.exact_live_bytes = 0
        self.exact_peak_bytes = 0
        self._tracked: set[int] = set()

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of tensors that already exist (a wrapper subclass's inner tensors')."""
        for tensor in tensors:
            for local in local_tensors(tensor):
                self._register(local)

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak_bytes = self.live_bytes
        self.exact_peak_bytes = self.exact_live_bytes

    def counted(self, size_bytes: int) -> int:
        """`size_bytes` of one storage as this tracker counts it."""
        return self.counting.of(size_bytes)

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        return all(id(local.untyped_storage()) in self._tracked for local in local_tensors(tensor))

    def _register(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        exact_bytes = storage.nbytes()
        if key in self._tracked or exact_bytes == 0:
            return
        self._tracked.add(key)
        size_bytes = self.counted(exact_bytes)
        self.live_bytes += size_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.exact_live_bytes += exact_bytes
        self.exact_peak_bytes = max(self.exact_peak_bytes, self.exact_live_bytes)
        weakref.finalize(storage, self._release, key, size_bytes, exact_bytes)

    def _release(self, key: int, size_bytes: int, exact_bytes: int) -> None:
        self._tracked.discard(key)
        self.live_bytes -= size_bytes
        self.exact_live_bytes -= exact_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        for tensor in tensors_in(output):
            for local in local_tensors(tensor):
                self._register(local)
        return output


AFTER_LAST_PHASE = "after the last phase"
"""`AllocatorPhases.peaks` key of what ran after the last `on_phase` call."""
PHASE_MARK = "planner.phase:"
"""Name prefix of the profiler events `AllocatorPhases` marks the end of each phase with."""


class AllocatorPhases:
    """Peak live bytes per phase from the CPU allocator's events (NOTE [compiled steps] in
    measurement.py).

    Use as a context manager; call `on_phase(name)` at the end of each phase. When the context exits,
    `peaks` holds each phase's peak and `ends` the live bytes at its (last) end, both with the storages
    of `resident` (alive before the window) added and each allocation counted as `counting` says (the
    current scope's by default); `exact_peaks` holds the peaks in exact bytes, and `event_names` the
    names of every profiler event seen.
    """

    def __init__(self, resident: Iterable[torch.Tensor] = (), counting: MemoryCounting | None = None) -> None:
        self.counting = current_counting() if counting is None else MemoryCounting(counting)
        self.resident_sizes = storage_sizes(resident)
        self.peaks: dict[str, int] = {}
        self.ends: dict[str, int] = {}
        self.exact_peaks: dict[str, int] = {}
        self.event_names: set[str] = set()
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )

    def on_phase(self, phase: str) -> None:
        with torch.profiler.record_function(PHASE_MARK + phase):
            pass

    def __enter__(self) -> AllocatorPhases:
        # Garbage from an earlier measurement would be freed inside the window (NOTE [frees from
        # before the window]); collect it first.
        gc.collect()
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._profiler.__exit__(*exc_info)
        assert self._profiler.profiler is not None and self._profiler.profiler.kineto_results is not None
        events = sorted(self._profiler.profiler.kineto_results.events(), key=lambda event: event.start_ns())
        self.event_names = {event.name() for event in events}
        marks = [
            # nbytes is in the binding, not its stub; a free is negative, and counted as its allocation was
            (event.name(), event.nbytes()) if event.name() == "[memory]" else (event.name(), 0)  # type: ignore[attr-defined]
            for event in events
        ]
        self.peaks, self.ends = _phase_peaks(marks, self.counting, self.resident_sizes)
        self.exact_peaks, _ = _phase_peaks(marks, MemoryCounting.EXACT, self.resident_sizes)


def _phase_peaks(
    marks: Sequence[tuple[str, int]], counting: MemoryCounting, resident_sizes: Sequence[int]
) -> tuple[dict[str, int], dict[str, int]]:
    """(peak, end) live bytes of each phase, from allocator events ("[memory]", signed exact bytes) and
    phase marks in time order, with the storages of `resident_sizes` (exact bytes) live from the start,
    each counted as `counting` says.

    NOTE [frees from before the window]
    The CPU allocator remembers the size of a block allocated under an earlier memory profile and
    reports its free in a later one, without an address. Garbage of an earlier measurement (an
    optimizer's state in a reference cycle, a cache a library drops) freed inside this window lowered
    the live bytes below what this window holds: a compiled peer measured 4.2 MB under its peak in one
    CI run, and a test's window measured 1 MiB low in two of four full runs. So a free counts only
    where it can be the free of a block this window knows of: a live allocation of the window of the
    same size, else a resident storage of that size; any other free is of a block allocated before
    the window and never counted, and is ignored.
    """
    peaks: dict[str, int] = {}
    ends: dict[str, int] = {}
    live_sizes = Counter[int]()
    resident = Counter[int](resident_sizes)
    live_bytes = phase_peak_bytes = sum(counting.of(size) * count for size, count in resident.items())
    unmarked = False
    for name, signed_bytes in marks:
        if name == "[memory]":
            size = abs(signed_bytes)
            if signed_bytes > 0:
                live_sizes[size] += 1
                live_bytes += counting.of(size)
            elif live_sizes[size] > 0 or resident[size] > 0:
                (live_sizes if live_sizes[size] > 0 else resident)[size] -= 1
                live_bytes -= counting.of(size)
            phase_peak_bytes = max(phase_peak_bytes, live_bytes)
            unmarked = True
        elif name.startswith(PHASE_MARK):
            phase = name.removeprefix(PHASE_MARK)
            peaks[phase] = max(peaks.get(phase, 0), phase_peak_bytes)
            ends[phase] = live_bytes
            phase_peak_bytes, unmarked = live_bytes, False
    if unmarked or not peaks:
        peaks[AFTER_LAST_PHASE] = phase_peak_bytes
    return peaks, ends


def storage_sizes(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Exact bytes of each distinct storage behind `tensors` (tied weights and views count once)."""
    locals_ = [local for tensor in tensors for local in local_tensors(tensor)]
    sizes = {local.untyped_storage().data_ptr(): local.untyped_storage().nbytes() for local in locals_}
    return list(sizes.values())


def storage_bytes(tensors: Iterable[torch.Tensor], counting: MemoryCounting | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (tied weights and views count once), each counted
    as `counting` says (the current scope's by default)."""
    counting = current_counting() if counting is None else counting
    return sum(counting.of(size_bytes) for size_bytes in storage_sizes(tensors))
