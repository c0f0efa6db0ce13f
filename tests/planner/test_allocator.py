"""The caching-allocator model (planner/simulation/allocator.py) against cases worked out by hand from
c10/cuda/CUDACachingAllocator.cpp, invariants over random malloc/free sequences, and torch's own
snapshot readers (torch.cuda._memory_viz), which run without CUDA."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from typing import Any

import pytest

from planner.simulation.allocator import (
    AllocatorPeaks,
    AllocatorSettings,
    CachingAllocatorModel,
    SimulatedOutOfMemory,
    allocation_size,
    replay,
    round_size,
)
from planner.simulation.allocator import roundup_power2_next_division as next_division

KIB = 2**10
MIB = 2**20

EXPANDABLE = AllocatorSettings(expandable_segments=True)
SPLIT_32MB = AllocatorSettings.from_conf("max_split_size_mb:32")


def blocks_of(model: CachingAllocatorModel) -> list[list[tuple[int, int, str]]]:
    """Per segment in address order: (offset in the segment, size, state or allocation name) per block."""
    layout = []
    for segment in model.snapshot()["segments"]:
        layout.append(
            [
                (
                    block["address"] - segment["address"],
                    block["size"],
                    block["frames"][0]["name"] if block["frames"] else block["state"],
                )
                for block in segment["blocks"]
            ]
        )
    return layout


def actions(model: CachingAllocatorModel) -> list[tuple[str, int]]:
    """(action, size) of every trace entry."""
    return [(entry["action"], entry["size"]) for entry in model.snapshot()["device_traces"][0]]


def validate(model: CachingAllocatorModel, live: dict[str, int], step: str) -> None:
    """The stats agree with the snapshot, segments tile their blocks, and each live allocation has one
    block at least as large as its request."""
    snapshot = model.snapshot()
    segments = snapshot["segments"]
    assert model.reserved_bytes >= model.allocated_bytes >= model.requested_bytes, step
    assert sum(segment["total_size"] for segment in segments) == model.reserved_bytes, step
    assert sum(segment["allocated_size"] for segment in segments) == model.allocated_bytes, step
    assert sum(segment["requested_size"] for segment in segments) == model.requested_bytes, step
    assert model.requested_bytes == sum(live.values()), step
    end = 0
    owners: dict[str, int] = {}
    for segment in segments:
        assert segment["address"] >= end, f"{step}: segments overlap"
        address = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == address and block["size"] > 0, f"{step}: blocks do not tile"
            address += block["size"]
            if block["state"] == "active_allocated":
                owners[block["frames"][0]["name"]] = block["size"]
                assert block["size"] >= block["requested_size"], step
        assert address == segment["address"] + segment["total_size"], f"{step}: blocks do not tile"
        end = address
    assert owners.keys() == {name for name, size in live.items() if size > 0}, step
    assert all(owners[name] >= live[name] for name in owners), step


def test_round_size_follows_kminblocksize() -> None:
    # round_size: below 512 B -> 512 B; otherwise up to a multiple of 512 B.
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024  # 513 = 512 + 1 -> 2 x 512
    assert round_size(3 * MIB + 1) == 3 * MIB + 512


def test_roundup_power2_divisions_round_to_the_next_step() -> None:
    # The source's own example: 1200 B lies in [1024, 2048); 4 divisions step by 256 B -> 1280 B.
    assert next_division(1200, 4) == 1280
    assert next_division(1024, 4) == 1024  # powers of two stay
    four = AllocatorSettings.from_conf("roundup_power2_divisions:4")
    # Only sizes above 512 B x 4 = 2048 B use the divisions: 1200 B rounds to 3 x 512 B.
    assert round_size(1200, four) == 1536
    # 1 MiB + 1 lies in [1 MiB, 2 MiB), steps of 256 KiB -> 1.25 MiB (512 B rounding would give 1 MiB + 512).
    assert round_size(MIB + 1, four) == MIB + 256 * KIB
    # 5 MiB + 1 lies in [4 MiB, 8 MiB): steps of 1 MiB -> 6 MiB.
    assert round_size(5 * MIB + 1, four) == 6 * MIB


def test_allocation_size_picks_the_segment_size() -> None:
    assert allocation_size(512) == 2 * MIB  # <= 1 MiB: kSmallBuffer
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB  # (1 MiB, 10 MiB): kLargeBuffer
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB  # >= 10 MiB: up to a multiple of 2 MiB
    assert allocation_size(11 * MIB) == 12 * MIB


def test_size_zero_allocates_nothing() -> None:
    # NativeCachingAllocator::allocate hands out a null pointer for 0 bytes without calling malloc.
    model = CachingAllocatorModel(record_trace=True)
    model.malloc("empty", 0)
    assert (model.allocated_bytes, model.reserved_bytes, model.requested_bytes) == (0, 0, 0)
    model.free("empty")
    assert model.snapshot() == {"segments": [], "device_traces": [[]]}


def test_a_small_allocation_reserves_a_2mib_segment() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 1)
    # 1 B -> 512 B from a new 2 MiB small segment; the 2 MiB - 512 B remainder is >= 512 B, so it is split.
    assert model.requested_bytes == 1
    assert model.allocated_bytes == 512
    assert model.reserved_bytes == 2 * MIB
    assert blocks_of(model) == [[(0, 512, "a"), (512, 2 * MIB - 512, "inactive")]]
    assert model.snapshot()["segments"][0]["segment_type"] == "small"


def test_two_small_allocations_share_a_segment() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 1000)  # -> 1024 B at offset 0
    model.malloc("b", 100 * KIB)  # 102400 B = 200 x 512 B, best fit is the remainder at offset 1024
    assert model.allocated_bytes == 1024 + 100 * KIB
    assert model.reserved_bytes == 2 * MIB
    rest = 2 * MIB - 1024 - 100 * KIB
    assert blocks_of(model) == [
        [(0, 1024, "a"), (1024, 100 * KIB, "b"), (1024 + 100 * KIB, rest, "inactive")]
    ]


def test_large_requests_under_10mib_share_a_20mib_segment() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 3 * MIB // 2)
    # 1.5 MiB > 1 MiB: large pool; < 10 MiB: a 20 MiB segment; remainder 18.5 MiB > 1 MiB: split.
    assert (model.allocated_bytes, model.reserved_bytes) == (3 * MIB // 2, 20 * MIB)
    model.malloc("b", 3 * MIB)
    # Best fit is the 18.5 MiB remainder; 15.5 MiB remains, still > 1 MiB: split again.
    assert (model.allocated_bytes, model.reserved_bytes) == (9 * MIB // 2, 20 * MIB)
    assert blocks_of(model) == [
        [(0, 3 * MIB // 2, "a"), (3 * MIB // 2, 3 * MIB, "b"), (9 * MIB // 2, 31 * MIB // 2, "inactive")]
    ]
    assert model.snapshot()["segments"][0]["segment_type"] == "large"


def test_requests_of_10mib_or_more_get_a_segment_rounded_to_2mib() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 12 * MIB)  # 12 MiB, already a multiple of 2 MiB: a 12 MiB segment, nothing left
    assert (model.allocated_bytes, model.reserved_bytes) == (12 * MIB, 12 * MIB)
    model.malloc("b", 11 * MIB + 1)
    # 11 MiB + 1 -> 11 MiB + 512 -> a 12 MiB segment; the 1 MiB - 512 B remainder is not > 1 MiB, so b
    # holds all 12 MiB (NOTE [unsplit blocks]): allocated 24 MiB, requested 23 MiB + 1.
    assert model.allocated_bytes == 24 * MIB
    assert model.requested_bytes == 23 * MIB + 1
    assert model.reserved_bytes == 24 * MIB
    assert blocks_of(model) == [[(0, 12 * MIB, "a")], [(0, 12 * MIB, "b")]]


@pytest.mark.parametrize(
    ("second_bytes", "split"),
    [
        (35 * MIB // 2, False),  # 18.5 - 17.5 = 1 MiB left: not > 1 MiB, b takes all 18.5 MiB
        (35 * MIB // 2 - 512, True),  # 1 MiB + 512 B left: split
        (71 * MIB // 4, False),  # 0.75 MiB left
    ],
)
def test_large_pool_splits_only_remainders_over_1mib(second_bytes: int, split: bool) -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 3 * MIB // 2)  # 20 MiB segment: a 1.5 MiB, cached remainder 18.5 MiB
    model.malloc("b", second_bytes)  # >= 10 MiB, but the cached 18.5 MiB block fits: no new segment
    assert model.reserved_bytes == 20 * MIB
    expected_allocated = 3 * MIB // 2 + (second_bytes if split else 37 * MIB // 2)
    assert model.allocated_bytes == expected_allocated
    assert model.requested_bytes == 3 * MIB // 2 + second_bytes


def test_freed_blocks_merge_with_neighbours_and_are_reused_best_fit() -> None:
    model = CachingAllocatorModel()
    for name, size in (("a", 4), ("b", 4), ("c", 4), ("d", 2)):
        model.malloc(name, size * MIB)
    # One 20 MiB segment: a [0, 4), b [4, 8), c [8, 12), d [12, 14), free [14, 20) (sizes in MiB).
    model.free("a")
    model.free("b")  # b merges with the free a before it: free [0, 8)
    assert blocks_of(model) == [
        [
            (0, 8 * MIB, "inactive"),
            (8 * MIB, 4 * MIB, "c"),
            (12 * MIB, 2 * MIB, "d"),
            (14 * MIB, 6 * MIB, "inactive"),
        ]
    ]
    # 5 MiB: best fit is the 6 MiB block at 14 (the 8 MiB one at 0 is larger); 1 MiB left is not > 1 MiB.
    model.malloc("e", 5 * MIB)
    # 6 MiB: the 8 MiB block at 0, split (2 MiB left).
    model.malloc("f", 6 * MIB)
    model.free("c")  # merges with the 2 MiB left at [6, 8): free [6, 12)
    model.free("d")  # merges again: free [6, 14)
    assert blocks_of(model) == [[(0, 6 * MIB, "f"), (6 * MIB, 8 * MIB, "inactive"), (14 * MIB, 6 * MIB, "e")]]
    assert model.allocated_bytes == 12 * MIB
    assert model.requested_bytes == 11 * MIB
    assert model.reserved_bytes == 20 * MIB


def test_fragmentation_grows_reserved_unless_segments_expand() -> None:
    # A batch that grows by 2 MiB per step: each request is a little larger than any cached block.
    events: list[Any] = []
    for step, size in enumerate((12, 14, 16, 18)):
        events += [("malloc", f"x{step}", size * MIB), ("free", f"x{step}")]
    # Default: a new segment per step, all kept cached: 12 + 14 + 16 + 18 = 60 MiB.
    assert replay(events) == AllocatorPeaks(18 * MIB, 60 * MIB, 18 * MIB, out_of_memory=None)
    # Expandable: 12 MiB maps one 20 MiB page; every later request fits in that page once x0 is freed.
    assert replay(events, EXPANDABLE) == AllocatorPeaks(18 * MIB, 20 * MIB, 18 * MIB, out_of_memory=None)


def test_expandable_segment_maps_pages_after_its_last_free_block() -> None:
    model = CachingAllocatorModel(EXPANDABLE)
    model.malloc("a", 3 * MIB // 2)  # maps one 20 MiB page; a takes 1.5 MiB, 18.5 MiB stay free
    assert model.reserved_bytes == 20 * MIB
    model.malloc("b", 30 * MIB)
    # No free block of 30 MiB: the free 18.5 MiB block grows by one more page (11.5 MiB short -> 20 MiB)
    # into 38.5 MiB, of which b takes 30 MiB. cudaMalloc segments would reserve 20 + 30 = 50 MiB.
    assert model.reserved_bytes == 40 * MIB
    assert blocks_of(model) == [
        [(0, 3 * MIB // 2, "a"), (3 * MIB // 2, 30 * MIB, "b"), (63 * MIB // 2, 17 * MIB // 2, "inactive")]
    ]
    assert model.snapshot()["segments"][0]["is_expandable"]
    model.free("a")
    model.free("b")
    model.empty_cache()  # unmaps both pages and drops the segment
    assert model.reserved_bytes == 0
    assert model.snapshot()["segments"] == []


def test_max_split_size_keeps_big_blocks_unsplit() -> None:
    model = CachingAllocatorModel(SPLIT_32MB)
    model.malloc("a", 40 * MIB)
    model.free("a")  # a cached 40 MiB block, >= 32 MiB: oversize
    model.malloc("b", 24 * MIB)
    # 24 MiB < 32 MiB may not take an oversize block: a new 24 MiB segment (default settings would split
    # the cached 40 MiB block instead and reserve 40 MiB).
    assert model.reserved_bytes == 64 * MIB
    model.malloc("c", 38 * MIB)
    # 38 MiB >= 32 MiB may take a block under 38 + 20 MiB, whole: c holds all 40 MiB.
    assert model.allocated_bytes == 24 * MIB + 40 * MIB
    assert model.requested_bytes == 62 * MIB
    assert model.reserved_bytes == 64 * MIB
    default = CachingAllocatorModel()
    default.malloc("a", 40 * MIB)
    default.free("a")
    default.malloc("b", 24 * MIB)
    assert default.reserved_bytes == 40 * MIB


@pytest.mark.parametrize(("request_mib", "reuses"), [(40, False), (41, True)])
def test_oversize_blocks_serve_requests_within_20mib(request_mib: int, reuses: bool) -> None:
    model = CachingAllocatorModel(SPLIT_32MB)
    model.malloc("a", 60 * MIB)
    model.free("a")
    model.malloc("b", request_mib * MIB)
    # get_free_block refuses a block of request + 20 MiB or more: 60 >= 40 + 20, 60 < 41 + 20.
    assert model.reserved_bytes == (60 if reuses else 100) * MIB
    assert model.allocated_bytes == (60 if reuses else 40) * MIB


def test_cached_segments_are_released_and_the_malloc_retried() -> None:
    model = CachingAllocatorModel(capacity_bytes=32 * MIB, record_trace=True)
    model.malloc("s", KIB)  # a 2 MiB small segment
    model.free("s")
    model.malloc("a", 12 * MIB)  # a 12 MiB segment
    model.free("a")
    assert model.reserved_bytes == 14 * MIB
    model.malloc("b", 20 * MIB)
    # 14 + 20 = 34 MiB > 32: cudaMalloc fails; no max_split_size, so release_cached_blocks frees both
    # cached segments (both pools) and the retry fits: 20 MiB reserved.
    assert model.reserved_bytes == 20 * MIB
    assert model.peak_reserved_bytes == 20 * MIB
    assert actions(model)[-4:] == [
        ("segment_free", 12 * MIB),
        ("segment_free", 2 * MIB),
        ("segment_alloc", 20 * MIB),
        ("alloc", 20 * MIB),
    ]


def test_max_split_size_releases_one_oversize_block_first() -> None:
    model = CachingAllocatorModel(SPLIT_32MB, capacity_bytes=100 * MIB, record_trace=True)
    for name, size in (("a", 60), ("x", 12)):
        model.malloc(name, size * MIB)
    model.free("a")
    model.free("x")
    # b = 34 MiB: the cached 60 MiB block is >= 34 + 20 MiB, so refused; 72 + 34 = 106 MiB > 100 fails.
    # release_available_cached_blocks frees the smallest cached block >= max(34, 32) MiB, the 60 MiB one,
    # and the retry fits; the 12 MiB segment stays cached.
    model.malloc("b", 34 * MIB)
    assert model.reserved_bytes == 12 * MIB + 34 * MIB
    assert actions(model)[-3:] == [
        ("segment_free", 60 * MIB),
        ("segment_alloc", 34 * MIB),
        ("alloc", 34 * MIB),
    ]


def test_expandable_segments_unmap_free_pages_before_an_oom() -> None:
    model = CachingAllocatorModel(EXPANDABLE, capacity_bytes=40 * MIB)
    model.malloc("a", 12 * MIB)  # large pool: one 20 MiB page, 8 MiB of it free after a
    model.malloc("s", KIB)  # small pool: one 2 MiB page
    model.free("s")
    assert model.reserved_bytes == 22 * MIB
    model.malloc("b", 21 * MIB)
    # The free 8 MiB must grow by one 20 MiB page: 22 + 20 = 42 MiB > 40 fails. release_cached_blocks
    # unmaps the small pool's free page (the 8 MiB in the large page holds no whole page), and the
    # retry maps 20 MiB: 28 MiB free, b takes 21 MiB.
    assert model.reserved_bytes == 40 * MIB
    assert model.allocated_bytes == 33 * MIB
    assert [segment["segment_type"] for segment in model.snapshot()["segments"]] == ["large"]


def test_out_of_memory_when_releasing_the_cache_is_not_enough() -> None:
    model = CachingAllocatorModel(capacity_bytes=30 * MIB, record_trace=True)
    model.malloc("a", 12 * MIB)
    with pytest.raises(SimulatedOutOfMemory) as raised:
        model.malloc("b", 20 * MIB)  # 12 + 20 = 32 MiB > 30, and nothing is cached to release
    error = raised.value
    assert (error.name, error.requested_bytes) == ("b", 20 * MIB)
    assert (error.allocated_bytes, error.reserved_bytes, error.capacity_bytes) == (
        12 * MIB,
        12 * MIB,
        30 * MIB,
    )
    assert "expandable_segments:True" in str(error)
    oom = model.snapshot()["device_traces"][0][-1]
    assert (oom["action"], oom["device_free"], oom["size"]) == ("oom", 18 * MIB, 20 * MIB)
    model.free("a")  # the model stays usable, as a caught torch.OutOfMemoryError leaves the allocator
    model.malloc("b", 20 * MIB)  # the cached 12 MiB segment is released on the retry
    assert model.reserved_bytes == 20 * MIB


def test_replay_reports_an_out_of_memory_and_the_peaks_before_it() -> None:
    events: list[Any] = [("malloc", "a", 12 * MIB), ("malloc", "b", 20 * MIB), ("free", "a")]
    peaks = replay(events, capacity_bytes=30 * MIB)
    assert (peaks.peak_allocated_bytes, peaks.peak_reserved_bytes) == (12 * MIB, 12 * MIB)
    assert peaks.out_of_memory is not None and "'b'" in peaks.out_of_memory
    assert replay(events[:1]).out_of_memory is None
    with pytest.raises(ValueError, match="neither"):
        replay([("malloc", "a")])


def test_names_must_be_live_exactly_once() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 1)
    with pytest.raises(ValueError, match="already live"):
        model.malloc("a", 1)
    with pytest.raises(ValueError, match="not live"):
        model.free("b")
    with pytest.raises(ValueError, match="non-negative"):
        model.malloc("c", -1)


def test_reset_peaks_restarts_from_the_current_values() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 12 * MIB)
    model.free("a")
    model.reset_peaks()
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes, model.peak_requested_bytes) == (
        0,
        12 * MIB,
        0,
    )


def test_from_conf_parses_the_modelled_options() -> None:
    settings = AllocatorSettings.from_conf(
        "expandable_segments:True, max_split_size_mb:128,max_non_split_rounding_mb:40,"
        "roundup_power2_divisions:[256:1,512:2,>:4],release_lock_on_cudamalloc:True"
    )
    assert settings.expandable_segments
    assert settings.max_split_size_bytes == 128 * MIB
    assert settings.max_non_split_rounding_bytes == 40 * MIB
    # 256 MB is interval 8 ([256 MiB, 512 MiB)); the first entry also covers 0-7, `>` covers 10-15.
    assert settings.roundup_power2_divisions == (1,) * 9 + (2,) + (4,) * 6
    assert AllocatorSettings.from_conf("") == AllocatorSettings()
    assert (
        AllocatorSettings.from_conf("backend:native,garbage_collection_threshold:0.6") == AllocatorSettings()
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("expandable_segments:true", "'expandable_segments' expects True or False"),
        ("max_split_size_mb:10", "'max_split_size_mb' is 10 MB, below"),
        ("max_split_size_mb:lots", "'max_split_size_mb' expects a non-negative integer"),
        ("colour:blue", "'colour' is not an allocator option"),
        ("per_process_memory_fraction:0.5", "'per_process_memory_fraction' is not modelled"),
        ("backend:cudaMallocAsync", "only the native caching allocator"),
        ("roundup_power2_divisions:[256:3]", "0 or a power of two, not 3"),
        ("roundup_power2_divisions:[256:1", "no closing"),
        ("expandable_segments", "expected `option:value`"),
        ("expandable_segments:True:False", "expected ','"),
        # ';' is no separator: the value runs on to the next ':'
        ("expandable_segments:True;max_split_size_mb:64", "not 'True;max_split_size_mb'"),
    ],
)
def test_from_conf_names_the_bad_part(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        AllocatorSettings.from_conf(text)


SETTINGS = [
    AllocatorSettings(),
    EXPANDABLE,
    SPLIT_32MB,
    AllocatorSettings.from_conf("expandable_segments:True,max_split_size_mb:32,roundup_power2_divisions:4"),
]


def random_size(rng: random.Random) -> int:
    """Sizes across the small pool, the shared 20 MiB segments and the rounded large segments."""
    return rng.choice(
        [
            rng.randint(1, 4 * KIB),
            rng.randint(1, 2 * MIB),
            rng.randint(MIB, 12 * MIB),
            rng.randint(10 * MIB, 70 * MIB),
        ]
    )


@pytest.mark.parametrize("settings", SETTINGS, ids=["default", "expandable", "max_split", "all"])
@pytest.mark.parametrize("seed", range(12))
def test_random_sequences_keep_the_invariants(settings: AllocatorSettings, seed: int) -> None:
    rng = random.Random(seed)
    capacity_bytes = rng.choice([None, 200 * MIB, 400 * MIB])
    model = CachingAllocatorModel(settings, capacity_bytes, record_trace=True)
    live: dict[str, int] = {}
    for step in range(250):
        if live and rng.random() < 0.45:
            name = rng.choice(sorted(live))
            model.free(name)
            del live[name]
        elif rng.random() < 0.03:
            model.empty_cache()
        else:
            name, size_bytes = f"t{step}", random_size(rng)
            try:
                model.malloc(name, size_bytes)
                live[name] = size_bytes
            except SimulatedOutOfMemory as error:
                assert error.requested_bytes == size_bytes
        validate(model, live, f"seed {seed} step {step}")
        assert capacity_bytes is None or model.reserved_bytes <= capacity_bytes
    for name in list(live):
        model.free(name)
    assert (model.allocated_bytes, model.requested_bytes) == (0, 0)
    model.empty_cache()
    assert model.reserved_bytes == 0 and model.snapshot()["segments"] == []


def test_snapshot_is_read_by_torch_memory_viz() -> None:
    from torch.cuda import _memory_viz as memory_viz

    models = []
    for settings in (AllocatorSettings(), EXPANDABLE):
        model = CachingAllocatorModel(settings, capacity_bytes=64 * MIB, record_trace=True)
        for name, size in (
            ("weight", 12 * MIB),
            ("activation", 3 * MIB // 2),
            ("bias", 100),
            ("grad", 6 * MIB),
        ):
            model.malloc(name, size)
        model.free("activation")
        with pytest.raises(SimulatedOutOfMemory):
            model.malloc("huge", 60 * MIB)
        models.append(model)
    before, after = (model.snapshot() for model in models)
    for snapshot in (before, after):
        segment_keys = {
            "address",
            "total_size",
            "stream",
            "segment_type",
            "segment_pool_id",
            "allocated_size",
        }
        assert segment_keys | {"active_size", "requested_size", "is_expandable", "blocks", "frames"} <= set(
            snapshot["segments"][0]
        )
        summary = memory_viz.segsum(snapshot)  # asserts that free + allocated adds up to reserved
        assert f"segments: {len(snapshot['segments'])}" in summary
        assert "raise OutOfMemoryError" in memory_viz.trace(snapshot)
        lines = memory_viz.segments(snapshot, format_flamegraph=lambda lines: lines)
        assert "weight" in lines and "grad" in lines
        assert "bias" in memory_viz.memory(snapshot, format_flamegraph=lambda lines: lines)
        assert "<html>" in memory_viz.trace_plot(snapshot)
        assert "<html>" in memory_viz.segment_plot(snapshot)
        assert pickle.loads(pickle.dumps(snapshot)) == snapshot
    # compare takes the segment lists (torch's own command line passes whole snapshots and fails)
    compared = memory_viz.compare(
        before["segments"], after["segments"], format_flamegraph=lambda lines: lines
    )
    assert "only_before" in compared and "only_after" in compared


def test_importing_the_model_does_not_import_torch() -> None:
    code = "import sys, planner.simulation.allocator; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
