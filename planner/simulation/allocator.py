"""A torch-free model of PyTorch's CUDA caching allocator: the segments it reserves for a sequence of
allocations and frees, and so what `torch.cuda.max_memory_reserved()` would report.

Why it exists: the simulator (step.py) predicts the bytes that live tensors hold, which is what
`max_memory_allocated` measures. A job runs out of memory when the allocator cannot *reserve* more, and
reserved memory also holds rounding, segment remainders too small to split off and cached free blocks
that best fit cannot reuse (fragmentation). Replaying a step's allocations through this model turns an
allocated peak into a reserved peak and tells whether `expandable_segments:True` or `max_split_size_mb`
would help, without a GPU. The REST service imports this module, so it never imports torch.

NOTE [allocator rules]: the rules are those of `DeviceCachingAllocator` in
c10/cuda/CUDACachingAllocator.cpp (read at pytorch commit 001074d2), checked against a later revision
that templates the same functions (`CachingDeviceAllocatorImpl`, which adds `max_non_split_rounding`)
and against c10/core/AllocatorConfig.cpp for the options. One method here per function there, under
the same name:

- `round_size`: a request is rounded up to a multiple of kMinBlockSize (512 B), 512 B at least; with
  `roundup_power2_divisions`, sizes above 512 B x divisions go up to the next of `divisions` equal steps
  between two powers of two instead (`roundup_power2_next_division`). Size 0 never reaches the
  allocator: `NativeCachingAllocator::allocate` hands out a null pointer for it.
- `get_pool`: a rounded size <= kSmallSize (1 MiB) comes from the small pool, anything larger from the
  large pool. Each pool caches its own free blocks.
- `get_free_block`: best fit, the cached block with the smallest (size, address) whose size is at least
  the request. With `max_split_size`, a request below it never gets a block of that size or more, and a
  request of that size or more only gets a block smaller than request + `max_non_split_rounding`
  (kLargeBuffer, 20 MiB, by default).
- `get_allocation_size` and `alloc_block`: with no cached block, cudaMalloc a segment of 2 MiB
  (kSmallBuffer) for the small pool, 20 MiB (kLargeBuffer) for requests under 10 MiB (kMinLargeAlloc),
  else the request rounded up to 2 MiB (kRoundLarge). cudaMalloc fails when the reserved bytes plus the
  segment exceed the device's capacity.
- `should_split`: the found block is split when what remains is at least 512 B in the small pool or
  with expandable segments; in the large pool, when it is more than 1 MiB and the request is below
  `max_split_size`. Otherwise the caller gets the whole block; see NOTE [unsplit blocks].
- `free_block`: a freed block merges with its free neighbours in the same segment (`try_merge_blocks`)
  and goes back to its pool's cache; nothing is returned to the device until a retry or `empty_cache`.

NOTE [unsplit blocks]: `allocated_bytes` (`stats.allocated_bytes`, what `memory_allocated()` reports)
counts the size of the block handed out, not the request: a request of 11 MiB + 1 B rounds to 11 MiB +
512 B and gets a 12 MiB segment whose 1 MiB - 512 B remainder is too small to split in the large pool,
so allocated_bytes grows by 12 MiB while `requested_bytes` grows by 11 MiB + 1 B. Hence reserved >=
allocated >= requested at every step.

NOTE [free and retry]: when cudaMalloc fails, `malloc` first calls `release_available_cached_blocks`,
which (only with `max_split_size`) cudaFrees the smallest cached block of at least
max(request, max_split_size), or else the largest cached oversize blocks until that many bytes are freed,
and retries; then `release_cached_blocks` (what `empty_cache` does), which cudaFrees every cached segment
that is not split (wholly free) in both pools, and unmaps every whole free page of the expandable
segments, and retries once more. Only then does it raise OutOfMemoryError, after recording an "oom"
trace entry. The releases stay done even when the retry fails.

NOTE [expandable segments]: with `expandable_segments:True` each pool gets one segment that reserves
address space for 9/8 of the device (`find_expandable_block`) and maps physical pages on demand, 2 MiB
pages for the small pool and 20 MiB pages for the large pool (`map_block`, `try_allocate_expandable_block`):
a request that no cached block fits maps just enough pages after the segment's last free block, which
then grows into one block that is split as usual. `get_free_block` ranks the free block in front of the
unmapped tail by its size plus the tail's, so best fit prefers blocks that cannot grow. Reserved bytes
are the mapped pages; `release_cached_blocks` unmaps the whole pages inside free blocks (`unmap_block`)
and drops a segment once nothing in it is mapped. A snapshot shows one segment per contiguous mapped
range, as `DeviceCachingAllocator::snapshot` does.

Simplifications, with what each costs:

- One device, one stream, no CUDA graphs or private pools, no `record_stream` events, no IPC and no
  free-memory callbacks: a training step's allocations on its main stream need none of them.
- The device is `capacity_bytes` of memory that only this allocator uses, with no driver or context
  overhead and no fragmentation of physical memory: cudaMalloc and page mapping succeed iff reserved +
  new bytes <= capacity. Pass the memory left after the CUDA context (and other processes) as capacity.
  A partly failed mapping maps nothing, as `ExpandableSegment::map` rolls back.
- Addresses are made up: segments are laid out upwards from `FIRST_SEGMENT_ADDRESS`, 2 MiB aligned, and
  a freed segment's address is not reused. Addresses only break ties between cached blocks of equal
  size, where best fit then takes the block of the older segment; the driver's real addresses, and so
  its choice, cannot be predicted.
- Options that change what we model and that we do not model (`per_process_memory_fraction`,
  `large_segment_size_mb`, `throw_on_cudamalloc_oom`, `backend:cudaMallocAsync`) are refused by
  `AllocatorSettings.from_conf`; `garbage_collection_threshold` acts only under a memory fraction, so it
  is accepted and has no effect. See `IGNORED_OPTIONS`.
- Trace times (`time_us`) count trace entries instead of microseconds, and `snapshot()` records no
  "snapshot" trace entry. Each expandable segment range reports the frames of the allocation that
  created the segment.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from planner.errors import PlannerError, format_bytes
from planner.simulation.allocator_conf import (
    DEFAULT_SETTINGS,
    IGNORED_OPTIONS,
    LARGE_BUFFER_BYTES,
    MIB,
    ROUNDUP_INTERVALS,
    UNMODELLED_OPTIONS,
    AllocatorSettings,
)

__all__ = [
    "FRAME_FILENAME",
    "IGNORED_OPTIONS",
    "UNMODELLED_OPTIONS",
    "AllocatorEvent",
    "AllocatorPeaks",
    "AllocatorSettings",
    "CachingAllocatorModel",
    "SimulatedOutOfMemory",
    "allocation_size",
    "apply_event",
    "replay",
    "round_size",
    "roundup_power2_next_division",
]

MIN_BLOCK_BYTES = 512
"""kMinBlockSize: every request is rounded up to a multiple of this."""
SMALL_SIZE_BYTES = MIB
"""kSmallSize: the largest request served by the small pool."""
SMALL_BUFFER_BYTES = 2 * MIB
"""kSmallBuffer: the small pool's segment size, and its expandable page size."""
MIN_LARGE_ALLOC_BYTES = 10 * MIB
"""kMinLargeAlloc: large requests below this share a kLargeBuffer segment."""
ROUND_LARGE_BYTES = 2 * MIB
"""kRoundLarge: segments of requests from 10 MiB up are rounded up to this."""
ROUNDUP_FIRST_INTERVAL_LOG2 = 20
"""log2 of 1 MiB, where interval 0 starts."""
FIRST_SEGMENT_ADDRESS = 0x7F00_0000_0000
"""Where made-up segment addresses start (a typical CUDA device pointer); see the module docstring."""
SEGMENT_ALIGNMENT_BYTES = 2 * MIB
"""Made-up segment addresses are aligned to this, like the driver's 2 MiB pages."""
UNLIMITED_ADDRESS_SPACE_BYTES = 2**48
"""The address space an expandable segment reserves on a device of unknown capacity (the source reserves
9/8 of the device's memory; 256 TiB is the GPU's whole virtual address space)."""
FRAME_FILENAME = "<simulated>"
"""The `filename` of the one frame that names each allocation in a snapshot."""

AllocatorEvent = tuple[Literal["malloc"], str, int] | tuple[Literal["free"], str]
"""One step of a replay: ("malloc", name, size_bytes) or ("free", name)."""


def roundup_power2_next_division(size_bytes: int, divisions: int) -> int:
    """`roundup_power2_next_division`: `size_bytes` up to the next of `divisions` equal steps between the
    powers of two around it (1200 B in 4 divisions of [1024, 2048) -> 1280 B)."""
    if size_bytes & (size_bytes - 1) == 0:
        return size_bytes
    power2_floor = 1 << (size_bytes.bit_length() - 1)
    step_bytes = power2_floor >> (divisions.bit_length() - 1)
    if step_bytes == 0:
        return power2_floor << 1
    floor_bytes = size_bytes & ~(step_bytes - 1)
    return size_bytes if floor_bytes == size_bytes else floor_bytes + step_bytes


def round_size(size_bytes: int, settings: AllocatorSettings = DEFAULT_SETTINGS) -> int:
    """`round_size`: the block size a request of `size_bytes` (> 0) asks the pools for."""
    if size_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    interval = max(size_bytes.bit_length() - 1 - ROUNDUP_FIRST_INTERVAL_LOG2, 0)
    divisions = settings.roundup_power2_divisions[min(interval, ROUNDUP_INTERVALS - 1)]
    if divisions > 1 and size_bytes > MIN_BLOCK_BYTES * divisions:
        return roundup_power2_next_division(size_bytes, divisions)
    return _round_up(size_bytes, MIN_BLOCK_BYTES)


def allocation_size(size_bytes: int) -> int:
    """`get_allocation_size`: the cudaMalloc size of a new segment for a rounded request."""
    if size_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return _round_up(size_bytes, ROUND_LARGE_BYTES)


def _round_up(size_bytes: int, multiple_bytes: int) -> int:
    return -(-size_bytes // multiple_bytes) * multiple_bytes


class SimulatedOutOfMemory(PlannerError):
    """The modelled allocator could not serve a request even after releasing its cache (NOTE [free and
    retry]); the message reads like PyTorch's OutOfMemoryError."""

    def __init__(
        self,
        *,
        name: str,
        requested_bytes: int,
        allocated_bytes: int,
        reserved_bytes: int,
        capacity_bytes: int,
    ) -> None:
        self.name = name
        self.requested_bytes = requested_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {format_bytes(requested_bytes)} for {name!r} "
            f"on a device of {format_bytes(capacity_bytes)} with "
            f"{format_bytes(capacity_bytes - reserved_bytes)} free; {format_bytes(allocated_bytes)} is "
            "allocated and "
            f"{format_bytes(reserved_bytes - allocated_bytes)} reserved but unallocated. If the reserved but "
            "unallocated memory is large, try expandable_segments:True; otherwise lower the memory budget."
        )


@dataclass(eq=False)
class _Segment:
    """One cudaMalloc'd segment, or the address range an expandable segment reserved."""

    address: int
    size_bytes: int
    is_small: bool
    page_bytes: int | None
    """The expandable segment's page size; None for a cudaMalloc'd segment."""
    created_by: str | None
    """The allocation whose malloc created the segment (its `context_when_segment_allocated`)."""


@dataclass(eq=False)
class _Block:
    """`Block`: a piece of a segment, allocated, cached free, or (expandable segments) not mapped."""

    address: int
    size_bytes: int
    segment: _Segment
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False
    mapped: bool = True
    requested_bytes: int = 0
    """The request of the block's latest allocation (stale once freed, as in the source)."""
    name: str | None = None
    """The allocation holding the block; None while it is free."""

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def end_address(self) -> int:
        return self.address + self.size_bytes


class _BlockPool:
    """`BlockPool`: the cached free mapped blocks of one pool in (size, address) order, and the unmapped
    blocks of its expandable segments."""

    def __init__(self, *, is_small: bool) -> None:
        self.is_small = is_small
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[tuple[int, int], _Block] = {}
        self.unmapped: set[_Block] = set()

    def __iter__(self) -> Iterator[_Block]:
        return iter([self._blocks[key] for key in self._keys])

    def insert(self, block: _Block) -> None:
        key = (block.size_bytes, block.address)
        assert key not in self._blocks, f"block {key} cached twice"
        self._keys.insert(self._lower_bound(key), key)
        self._blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = (block.size_bytes, block.address)
        assert self._blocks.get(key) is block, f"block {key} is not cached"
        del self._keys[self._lower_bound(key)]
        del self._blocks[key]

    def lower_bound(self, size_bytes: int) -> int:
        """The position of the first cached block of at least `size_bytes`."""
        return self._lower_bound((size_bytes, 0))

    def at(self, position: int) -> _Block | None:
        return self._blocks[self._keys[position]] if 0 <= position < len(self._keys) else None

    def _lower_bound(self, key: tuple[int, int]) -> int:
        low, high = 0, len(self._keys)
        while low < high:
            middle = (low + high) // 2
            if self._keys[middle] < key:
                low = middle + 1
            else:
                high = middle
        return low


@dataclass
class _Stat:
    """`Stat`: a current value and its peak since the last reset."""

    current: int = 0
    peak: int = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        self.peak = max(self.peak, self.current)

    def decrease(self, amount: int) -> None:
        self.current -= amount
        assert self.current >= 0, "a byte count went negative"


@dataclass(frozen=True)
class _TraceEntry:
    action: str
    address: int
    """The block or segment address; for "oom", the device's free bytes (the source's `addr_`)."""
    size_bytes: int
    name: str | None
    """The allocation whose frames the entry shows (its context)."""
    time_us: int


def _frames(name: str | None) -> list[dict[str, Any]]:
    """A snapshot's stack: one frame naming the allocation, so that pytorch.org/memory_viz shows it."""
    return [] if name is None else [{"filename": FRAME_FILENAME, "line": 0, "name": name}]


def _expandable_bytes(block: _Block) -> int:
    """The size a free block could grow to: its own plus the unmapped block after it."""
    following = block.next
    return block.size_bytes + (following.size_bytes if following is not None and not following.mapped else 0)


def _has_address_space(block: _Block | None, size_bytes: int) -> bool:
    """Whether unallocated (free or unmapped) blocks from `block` on cover `size_bytes`."""
    covered_bytes = 0
    while covered_bytes < size_bytes and block is not None and not block.allocated:
        covered_bytes += block.size_bytes
        block = block.next
    return covered_bytes >= size_bytes


def _mapped_runs(blocks: list[_Block]) -> Iterator[list[_Block]]:
    """A segment's blocks (in address order) as maximal runs of mapped blocks."""
    run: list[_Block] = []
    for block in blocks:
        if block.mapped:
            run.append(block)
        elif run:
            yield run
            run = []
    if run:
        yield run


class CachingAllocatorModel:
    """The caching allocator of one CUDA device, replayed on sizes alone (NOTE [allocator rules]).

    `malloc` and `free` name each allocation; the name becomes the allocation's one stack frame in
    `snapshot()`. Byte counts and their peaks are those of `torch.cuda.memory_stats()` (aggregate pool).
    """

    def __init__(
        self,
        settings: AllocatorSettings = DEFAULT_SETTINGS,
        capacity_bytes: int | None = None,
        *,
        record_trace: bool = False,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be positive, or None for no limit")
        self.settings = settings
        self.capacity_bytes = capacity_bytes
        self.record_trace = record_trace
        self._small = _BlockPool(is_small=True)
        self._large = _BlockPool(is_small=False)
        self._live: dict[str, _Block | None] = {}
        self._allocated = _Stat()
        self._reserved = _Stat()
        self._requested = _Stat()
        self._next_address = FIRST_SEGMENT_ADDRESS
        self._trace: list[_TraceEntry] = []

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the blocks handed out (NOTE [unsplit blocks]): `memory_allocated()`."""
        return self._allocated.current

    @property
    def requested_bytes(self) -> int:
        """Bytes the live allocations asked for: `memory_stats()["requested_bytes.all.current"]`."""
        return self._requested.current

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the segments (mapped pages with expandable segments): `memory_reserved()`."""
        return self._reserved.current

    @property
    def peak_allocated_bytes(self) -> int:
        return self._allocated.peak

    @property
    def peak_reserved_bytes(self) -> int:
        return self._reserved.peak

    @property
    def peak_requested_bytes(self) -> int:
        return self._requested.peak

    def reset_peaks(self) -> None:
        """`resetPeakStats`: every peak restarts from its current value."""
        for stat in (self._allocated, self._reserved, self._requested):
            stat.peak = stat.current

    def malloc(self, name: str, size_bytes: int) -> None:
        """`malloc`: allocate `size_bytes` under `name`; raises SimulatedOutOfMemory as PyTorch would."""
        if name in self._live:
            raise ValueError(f"allocation {name!r} is already live; free it before allocating it again")
        if size_bytes < 0:
            raise ValueError(f"allocation {name!r} asks for {size_bytes} bytes; sizes are non-negative")
        if size_bytes == 0:
            self._live[name] = None
            return
        rounded_bytes = round_size(size_bytes, self.settings)
        pool = self._small if rounded_bytes <= SMALL_SIZE_BYTES else self._large
        block = self._get_free_block(pool, rounded_bytes)
        if block is None:
            block = self._alloc_block_with_retries(pool, rounded_bytes, name)
        if block is None:
            raise self._out_of_memory(name, size_bytes, rounded_bytes)
        self._live[name] = self._alloc_found_block(
            block,
            rounded_bytes,
            requested_bytes=size_bytes,
            name=name,
            split=self._should_split(block, rounded_bytes),
        )

    def free(self, name: str) -> None:
        """`free`: return the allocation `name` to its pool's cache, merged with free neighbours."""
        if name not in self._live:
            raise ValueError(f"allocation {name!r} is not live; allocate it before freeing it")
        block = self._live.pop(name)
        if block is None:
            return
        block.allocated = False
        self._allocated.decrease(block.size_bytes)
        self._record("free_requested", block.address, block.requested_bytes, name)
        self._free_block(block, name)

    def empty_cache(self) -> None:
        """`emptyCache`: `release_cached_blocks`, see NOTE [free and retry]."""
        self._release_cached_blocks(context=None)

    def snapshot(self) -> dict[str, Any]:
        """The dict `torch.cuda.memory._snapshot()` returns: "segments" (each with its "blocks") sorted by
        address and, with `record_trace`, "device_traces" holding one list of trace entries."""
        by_segment: dict[_Segment, list[_Block]] = {}
        live = (block for block in self._live.values() if block is not None)
        for block in (*self._small, *self._small.unmapped, *self._large, *self._large.unmapped, *live):
            by_segment.setdefault(block.segment, []).append(block)
        segments = [
            self._segment_record(segment, run)
            for segment, blocks in by_segment.items()
            for run in _mapped_runs(sorted(blocks, key=lambda block: block.address))
        ]
        segments.sort(key=lambda record: record["address"])
        return {"segments": segments, "device_traces": [[self._trace_record(e) for e in self._trace]]}

    def _get_free_block(self, pool: _BlockPool, rounded_bytes: int) -> _Block | None:
        """`get_free_block`: best fit, the max_split_size rules, and expandable blocks ranked by the size
        they could grow to (NOTE [expandable segments])."""
        position = pool.lower_bound(rounded_bytes)
        block = pool.at(position)
        if block is None:
            return None
        following = pool.at(position + 1)
        while following is not None and block.segment.page_bytes is not None:
            if _expandable_bytes(following) >= _expandable_bytes(block):
                break
            position, block, following = position + 1, following, pool.at(position + 2)
        max_split_bytes = self.settings.max_split_size_bytes
        if max_split_bytes is not None:
            if rounded_bytes < max_split_bytes <= block.size_bytes:
                return None
            rounding_bytes = self.settings.max_non_split_rounding_bytes
            if rounded_bytes >= max_split_bytes and block.size_bytes >= rounded_bytes + rounding_bytes:
                return None
        pool.remove(block)
        return block

    def _alloc_block_with_retries(self, pool: _BlockPool, rounded_bytes: int, context: str) -> _Block | None:
        """`alloc_block`, then the releases of NOTE [free and retry] each followed by another try."""
        block = self._alloc_block(pool, rounded_bytes, context)
        if block is None and self._release_available_cached_blocks(pool, rounded_bytes, context):
            block = self._alloc_block(pool, rounded_bytes, context)
        if block is None:
            self._release_cached_blocks(context)
            block = self._alloc_block(pool, rounded_bytes, context)
        return block

    def _alloc_block(self, pool: _BlockPool, rounded_bytes: int, context: str) -> _Block | None:
        """`alloc_block`: a new segment (cudaMalloc) or pages mapped into an expandable segment."""
        if self.settings.expandable_segments:
            return self._try_allocate_expandable_block(pool, rounded_bytes, context)
        segment_bytes = allocation_size(rounded_bytes)
        if not self._device_fits(segment_bytes):
            return None
        segment = self._new_segment(segment_bytes, is_small=pool.is_small, page_bytes=None, context=context)
        self._reserved.increase(segment_bytes)
        self._record("segment_alloc", segment.address, segment_bytes, context)
        return _Block(segment.address, segment_bytes, segment)

    def _device_fits(self, size_bytes: int) -> bool:
        return self.capacity_bytes is None or self._reserved.current + size_bytes <= self.capacity_bytes

    def _new_segment(
        self, size_bytes: int, *, is_small: bool, page_bytes: int | None, context: str
    ) -> _Segment:
        segment = _Segment(self._next_address, size_bytes, is_small, page_bytes, context)
        self._next_address += _round_up(size_bytes, SEGMENT_ALIGNMENT_BYTES)
        return segment

    def _should_split(self, block: _Block, rounded_bytes: int) -> bool:
        """`should_split`, see NOTE [unsplit blocks]."""
        remaining_bytes = block.size_bytes - rounded_bytes
        if block.segment.is_small or self.settings.expandable_segments:
            return remaining_bytes >= MIN_BLOCK_BYTES
        max_split_bytes = self.settings.max_split_size_bytes
        below_max_split = max_split_bytes is None or rounded_bytes < max_split_bytes
        return below_max_split and remaining_bytes > SMALL_SIZE_BYTES

    def _alloc_found_block(
        self, block: _Block, rounded_bytes: int, *, requested_bytes: int, name: str, split: bool
    ) -> _Block:
        """`alloc_found_block`: hand out `block`, or its first `rounded_bytes` with the rest cached."""
        if split:
            remaining = block
            block = _Block(
                remaining.address, rounded_bytes, remaining.segment, prev=remaining.prev, next=remaining
            )
            if block.prev is not None:
                block.prev.next = block
            remaining.prev = block
            remaining.address += rounded_bytes
            remaining.size_bytes -= rounded_bytes
            self._pool_of(remaining).insert(remaining)
        block.allocated = True
        block.requested_bytes = requested_bytes
        block.name = name
        self._record("alloc", block.address, requested_bytes, name)
        self._allocated.increase(block.size_bytes)
        self._requested.increase(requested_bytes)
        return block

    def _free_block(self, block: _Block, context: str | None) -> None:
        """`free_block`: merge with free neighbours and cache."""
        self._record("free_completed", block.address, block.requested_bytes, context or block.name)
        block.name = None
        for neighbour in (block.prev, block.next):
            self._try_merge_blocks(block, neighbour)
        self._pool_of(block).insert(block)
        self._requested.decrease(block.requested_bytes)

    def _try_merge_blocks(self, block: _Block, neighbour: _Block | None) -> None:
        """`try_merge_blocks`: absorb `neighbour` into `block` when it is free and mapped alike."""
        if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
            return
        pool = self._pool_of(neighbour)
        if neighbour.mapped:
            pool.remove(neighbour)
        else:
            pool.unmapped.remove(neighbour)
        if block.prev is neighbour:
            block.address = neighbour.address
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size_bytes += neighbour.size_bytes

    def _pool_of(self, block: _Block) -> _BlockPool:
        return self._small if block.segment.is_small else self._large

    def _release_available_cached_blocks(self, pool: _BlockPool, rounded_bytes: int, context: str) -> bool:
        """`release_available_cached_blocks`, see NOTE [free and retry]."""
        max_split_bytes = self.settings.max_split_size_bytes
        if max_split_bytes is None:
            return False
        target_bytes = max(rounded_bytes, max_split_bytes)
        position = pool.lower_bound(target_bytes)
        block = pool.at(position)
        if block is not None and block.segment.page_bytes is None:
            self._release_block(block, context)
            return True
        released_bytes = 0
        position -= 1
        while released_bytes < target_bytes and (block := pool.at(position)) is not None:
            if block.size_bytes < max_split_bytes:
                break
            if block.segment.page_bytes is None:
                released_bytes += block.size_bytes
                self._release_block(block, context)
            position -= 1
        return released_bytes >= target_bytes

    def _release_cached_blocks(self, context: str | None) -> None:
        """`release_cached_blocks`: `release_blocks` of both pools."""
        for pool in (self._large, self._small):
            self._release_blocks(pool, context)

    def _release_blocks(self, pool: _BlockPool, context: str | None) -> None:
        """`release_blocks`: cudaFree unsplit cached segments, unmap free pages of expandable ones."""
        to_unmap = []
        for block in pool:
            if block.segment.page_bytes is not None:
                to_unmap.append(block)
            elif not block.is_split:
                self._release_block(block, context)
        for block in to_unmap:
            self._unmap_block(block, context)
            if not block.is_split:
                assert not block.mapped, "an expandable segment was released with pages mapped"
                pool.unmapped.remove(block)

    def _release_block(self, block: _Block, context: str | None) -> None:
        """`release_block`: cudaFree the segment of a cached unsplit block."""
        assert not block.is_split and block.segment.page_bytes is None, "only whole segments are freed"
        self._pool_of(block).remove(block)
        self._reserved.decrease(block.size_bytes)
        self._record("segment_free", block.address, block.size_bytes, context or block.segment.created_by)

    def _find_expandable_block(self, pool: _BlockPool, rounded_bytes: int, context: str) -> _Block:
        """`find_expandable_block`: the lowest unmapped range (with the free block before it) that can hold
        `rounded_bytes`, or a new expandable segment's whole unmapped range."""
        for unmapped in sorted(pool.unmapped, key=lambda block: block.address):
            start = unmapped.prev if unmapped.prev is not None and not unmapped.prev.allocated else unmapped
            if _has_address_space(start, rounded_bytes):
                return start
        page_bytes = SMALL_BUFFER_BYTES if pool.is_small else LARGE_BUFFER_BYTES
        capacity_bytes = self.capacity_bytes
        device_bytes = UNLIMITED_ADDRESS_SPACE_BYTES if capacity_bytes is None else capacity_bytes * 9 // 8
        segment_bytes = _round_up(device_bytes, page_bytes)
        segment = self._new_segment(
            segment_bytes, is_small=pool.is_small, page_bytes=page_bytes, context=context
        )
        candidate = _Block(segment.address, segment_bytes, segment, mapped=False)
        pool.unmapped.add(candidate)
        return candidate

    def _try_allocate_expandable_block(
        self, pool: _BlockPool, rounded_bytes: int, context: str
    ) -> _Block | None:
        """`try_allocate_expandable_block`: map pages until a free block of `rounded_bytes` exists, and
        take it."""
        candidate = self._find_expandable_block(pool, rounded_bytes, context)
        if not candidate.mapped and not self._map_block(
            candidate, min(candidate.size_bytes, rounded_bytes), context
        ):
            return None
        while candidate.size_bytes < rounded_bytes:
            following = candidate.next
            assert following is not None and not following.mapped, "a free block is followed by a mapped one"
            if not self._map_block(
                following, min(rounded_bytes - candidate.size_bytes, following.size_bytes), context
            ):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _map_block(self, block: _Block, size_bytes: int, context: str) -> bool:
        """`map_block`: map the pages covering the first `size_bytes` of an unmapped block and merge it
        with free neighbours; False when the device has no room for the pages."""
        page_bytes = block.segment.page_bytes
        assert page_bytes is not None and not block.mapped
        mapped_bytes = _round_up(size_bytes, page_bytes)
        if not self._device_fits(mapped_bytes):
            return False
        pool = self._pool_of(block)
        pool.unmapped.remove(block)
        block.mapped = True
        mapped_address = block.address
        if mapped_bytes < block.size_bytes:
            remaining = _Block(
                block.address + mapped_bytes,
                block.size_bytes - mapped_bytes,
                block.segment,
                prev=block,
                next=block.next,
                mapped=False,
            )
            if block.next is not None:
                block.next.prev = remaining
            block.next = remaining
            block.size_bytes = mapped_bytes
            pool.unmapped.add(remaining)
        self._try_merge_blocks(block, block.prev)
        self._try_merge_blocks(block, block.next)
        pool.insert(block)
        self._reserved.increase(mapped_bytes)
        self._record("segment_map", mapped_address, mapped_bytes, context)
        return True

    def _unmap_block(self, block: _Block, context: str | None) -> None:
        """`unmap_block`: unmap the whole pages inside a cached free block; what is left around them stays
        cached as free blocks."""
        page_bytes = block.segment.page_bytes
        assert page_bytes is not None
        base = block.segment.address
        begin = base + _round_up(block.address - base, page_bytes)
        end = base + (block.end_address - base) // page_bytes * page_bytes
        if begin >= end:
            return
        pool = self._pool_of(block)
        pool.remove(block)
        if begin > block.address:
            before = _Block(block.address, begin - block.address, block.segment, prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        if end < block.end_address:
            after = _Block(end, block.end_address - end, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.address, block.size_bytes, block.mapped = begin, end - begin, False
        self._try_merge_blocks(block, block.prev)
        self._try_merge_blocks(block, block.next)
        pool.unmapped.add(block)
        self._reserved.decrease(end - begin)
        self._record("segment_unmap", begin, end - begin, context or block.segment.created_by)

    def _out_of_memory(self, name: str, size_bytes: int, rounded_bytes: int) -> SimulatedOutOfMemory:
        """The error `malloc` raises, after the "oom" trace entry (its address is the device's free bytes)."""
        assert self.capacity_bytes is not None, "only a device of limited capacity runs out of memory"
        self._record("oom", self.capacity_bytes - self._reserved.current, rounded_bytes, name)
        return SimulatedOutOfMemory(
            name=name,
            requested_bytes=size_bytes,
            allocated_bytes=self._allocated.current,
            reserved_bytes=self._reserved.current,
            capacity_bytes=self.capacity_bytes,
        )

    def _record(self, action: str, address: int, size_bytes: int, context: str | None) -> None:
        if self.record_trace:
            self._trace.append(_TraceEntry(action, address, size_bytes, context, time_us=len(self._trace)))

    @staticmethod
    def _trace_record(entry: _TraceEntry) -> dict[str, Any]:
        """A trace entry as `_memory_snapshot_pickled` writes it."""
        return {
            "action": entry.action,
            ("device_free" if entry.action == "oom" else "addr"): entry.address,
            "size": entry.size_bytes,
            "stream": 0,
            "frames": _frames(entry.name),
            "time_us": entry.time_us,
        }

    def _segment_record(self, segment: _Segment, blocks: list[_Block]) -> dict[str, Any]:
        """One segment (one mapped range of an expandable segment) as `_memory_snapshot_pickled` writes it."""
        allocated = [block for block in blocks if block.allocated]
        return {
            "device": 0,
            "address": blocks[0].address,
            "total_size": sum(block.size_bytes for block in blocks),
            "allocated_size": sum(block.size_bytes for block in allocated),
            "active_size": sum(block.size_bytes for block in allocated),
            "requested_size": sum(block.requested_bytes for block in allocated),
            "stream": 0,
            "segment_type": "small" if segment.is_small else "large",
            "segment_pool_id": (0, 0),
            "is_expandable": segment.page_bytes is not None,
            "frames": _frames(segment.created_by),
            "blocks": [
                {
                    "address": block.address,
                    "size": block.size_bytes,
                    "requested_size": block.requested_bytes,
                    "state": "active_allocated" if block.allocated else "inactive",
                    "frames": _frames(block.name),
                }
                for block in blocks
            ],
        }


@dataclass(frozen=True)
class AllocatorPeaks:
    """What `replay` found: the peaks of `torch.cuda.memory_stats()` over the events."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    out_of_memory: str | None
    """Why the replay stopped (the SimulatedOutOfMemory message), or None when every event ran; the peaks
    then cover the events before the failing one."""


def replay(
    events: Iterable[AllocatorEvent],
    settings: AllocatorSettings = DEFAULT_SETTINGS,
    capacity_bytes: int | None = None,
) -> AllocatorPeaks:
    """Run `events` through a fresh CachingAllocatorModel and report its peaks, stopping at an OOM as the
    program would."""
    model = CachingAllocatorModel(settings, capacity_bytes)
    out_of_memory = None
    try:
        for event in events:
            apply_event(model, event)
    except SimulatedOutOfMemory as error:
        out_of_memory = str(error)
    return AllocatorPeaks(
        peak_allocated_bytes=model.peak_allocated_bytes,
        peak_reserved_bytes=model.peak_reserved_bytes,
        peak_requested_bytes=model.peak_requested_bytes,
        out_of_memory=out_of_memory,
    )


def apply_event(model: CachingAllocatorModel, event: AllocatorEvent) -> None:
    """Run one ("malloc", name, bytes) or ("free", name) event on `model`."""
    match event:
        case ("malloc", str(name), int(size_bytes)):
            model.malloc(name, size_bytes)
        case ("free", str(name)):
            model.free(name)
        case _:
            raise ValueError(
                f"allocator event {event!r} is neither ('malloc', name, size_bytes) nor ('free', name)"
            )
