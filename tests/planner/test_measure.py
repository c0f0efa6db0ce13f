"""The CPU peak measurement: the live-storage tracker against PyTorch's MemTracker and by hand."""

from __future__ import annotations

import copy
import gc

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import planner
from planner.ir import MemoryCounting
from planner.profiler.counting import AllocatorPhases, LiveStorageTracker
from planner.profiler.measurement import default_loss
from planner.zoo import build_model


def test_tracker_agrees_with_mem_tracker_byte_for_byte() -> None:
    """MemTracker counts exact bytes on the CPU (and 512-byte blocks on CUDA only)."""
    model, inputs = build_model("cnn_bn_dropout")
    ours = planner.measure(copy.deepcopy(model), inputs, optimizer="adam").exact_peak_bytes
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    reference = MemTracker()
    reference.track_external(model, optimizer, *inputs)
    with reference:
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            default_loss(model(*inputs)).backward()
            optimizer.step()
            reference.reset_mod_stats()
    assert ours == reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_views_count_once_and_frees_are_subtracted() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        base = torch.zeros(1024)  # 4 KiB
        view = base.view(32, 32)
        assert tracker.live_bytes == 4096
        doubled = view * 2
        assert tracker.live_bytes == 8192
        del base
        assert tracker.live_bytes == 8192, "the view still holds the base's storage"
        del view
        assert tracker.live_bytes == 4096
        del doubled
    assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 8192


def test_measure_reports_each_phase_and_trains_the_model() -> None:
    model, inputs = build_model("seed000_mlp")
    before = [p.detach().clone() for p in model.parameters()]
    step = planner.measure(model, inputs, optimizer="sgd", timed_steps=2)
    assert set(step.phase_peak_bytes) == {"forward", "backward", "optimizer step"}
    assert step.peak_bytes == max(step.phase_peak_bytes.values())
    assert step.step_ms is not None and step.step_ms > 0
    assert step.device == "cpu"
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_the_tracker_counts_each_storage_in_512_byte_blocks_and_exactly() -> None:
    """CUDA's caching allocator rounds a storage to max(512, ceil(n / 512) * 512) bytes; a view adds
    nothing and an empty tensor allocates nothing."""
    tracker = LiveStorageTracker()
    with tracker:
        one = torch.ones(1, dtype=torch.uint8)  # 1 byte -> 512
        odd = torch.ones(513, dtype=torch.uint8)  # 513 -> 1,024
        even = torch.ones(256, dtype=torch.float32)  # 1,024 -> 1,024
        view = even[:10]
        empty = torch.ones(0)
        assert tracker.live_bytes == 512 + 1024 + 1024
        assert tracker.exact_live_bytes == 1 + 513 + 1024
        del one, odd
    assert tracker.live_bytes == 1024 and tracker.exact_live_bytes == 1024
    assert tracker.peak_bytes == 2560 and tracker.exact_peak_bytes == 1538
    del view, empty, even


def test_a_measured_step_reports_blocks_and_exact_bytes() -> None:
    """`peak_bytes` is what a GPU counts; `exact_peak_bytes` the tensors' own bytes; blocks never less."""
    model, inputs = build_model("cnn_bn_dropout")
    step = planner.measure(model, inputs)
    assert step.exact_peak_bytes < step.peak_bytes < step.exact_peak_bytes * 1.01
    assert step.peak_in(MemoryCounting.BLOCKS) == step.peak_bytes
    assert step.peak_in(MemoryCounting.EXACT) == step.exact_peak_bytes
    assert step.reserved_peak_bytes is None  # the CPU has no caching allocator


def test_garbage_from_an_earlier_measurement_does_not_lower_a_later_one() -> None:
    """The CPU allocator reports, in a later memory profile, the free of a block allocated under an
    earlier one. A cycle of garbage holding such a block, collected inside the window before the
    window allocates, lowered the measured peak by the garbage's size (most likely why a compiled
    peer measured 4.2 MB low in one CI run); `AllocatorPhases` collects garbage before its window."""

    class Cycle:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor
            self.me = self

    with AllocatorPhases():
        Cycle(torch.ones(1_000_000))  # 4 MB, unreachable at once, held by its own cycle
    with AllocatorPhases() as window:
        gc.collect()  # the collector runs during the step, before it allocates
        kept = torch.ones(500_000)
    assert max(window.exact_peaks.values()) == kept.untyped_storage().nbytes()


def test_a_free_of_a_block_from_an_earlier_window_is_not_counted() -> None:
    """NOTE [frees from before the window]: the free of a block a window never saw allocated (here one
    allocated under an earlier window, still alive when this one opens) leaves the live bytes alone."""
    with AllocatorPhases():
        earlier = torch.ones(262_144)  # 1 MiB, allocated under the earlier window
    with AllocatorPhases() as window:
        del earlier
        kept = torch.ones(500_000)
    assert max(window.exact_peaks.values()) == kept.untyped_storage().nbytes()


def test_a_resident_storage_freed_inside_the_window_leaves_the_live_bytes() -> None:
    resident = [torch.ones(1_000_000)]
    with AllocatorPhases():
        resident.append(torch.ones(250_000))  # 1 MB whose free a later window is told of
    with AllocatorPhases(resident, MemoryCounting.EXACT) as window:
        window.on_phase("both resident")
        resident.pop()
        window.on_phase("one freed")
    assert window.ends == {"both resident": 5_000_000, "one freed": 4_000_000}
