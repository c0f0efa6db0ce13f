"""What one data-parallel rank holds, as the live-storage tracker counts it under DDP and FSDP2.

Why it exists: `LiveStorageTracker` (counting.py) sees the storages operators create and frees them
when they are collected. Under data parallelism a rank also holds memory that no operator creates and
no collection frees, and `measure_step` must count it to measure what the per-rank plan predicts
(profiler/sharding.py):

- FSDP2 (`fully_shard`) keeps its parameters as DTensors, whose storage is the local shard (padded to
  an even split), and frees and re-allocates a unit's unsharded parameters by resizing their storages
  (`free_storage`/`alloc_storage` in torch/distributed/fsdp/_fully_shard/_fsdp_param.py call
  `untyped_storage().resize_`), which no TorchDispatchMode sees. `ResizingStorageTracker` counts each
  storage at its current size, read before and after every operator, and the tensors inside a wrapper
  subclass (a DTensor's `_local_tensor`) rather than the wrapper (`local_tensors`, NOTE [wrapper
  subclasses] in counting.py).
- DDP allocates its gradient buckets in C++ when the model is wrapped (the `Reducer`), so no operator
  of the step creates them; `ddp_bucket_sizes` reads their sizes from the reducer, and the measurement
  counts them as resident, like the parameters, with stand-ins (`ResizingStorageTracker.hold`), as no
  Python call hands out the buckets themselves. The tracker meets a bucket when the first backward
  copies a gradient into it (an operator writing into a storage it did not create): the first such
  storage of a stand-in's size takes the stand-in's place, so the bucket counts once. DDP rebuilds its
  buckets in the order of the first backward (the second iteration's forward,
  `DistributedDataParallel._pre_forward` calls `reducer._rebuild_buckets()`): when that rebuild is due,
  `ddp_bucket_sizes` makes it before the measurement starts; when it comes inside the window (the first
  step is measured), the new buckets are made by operators the tracker sees, and the old ones it took
  in are freed.

Gloo's own transport buffers are allocated by gloo, not by torch, and are not counted, as NCCL's are
not counted by CUDA's caching allocator either.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from planner.ir import MemoryCounting
from planner.profiler.counting import LiveStorageTracker, local_tensors, tensors_in

__all__ = ["ResizingStorageTracker", "ddp_bucket_sizes", "is_data_parallel"]


def is_data_parallel(model: torch.nn.Module) -> bool:
    """Whether `model` is wrapped by DDP or holds parameters that FSDP2 shards (DTensors)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    return any(is_traceable_wrapper_subclass(parameter) for parameter in model.parameters())


def ddp_bucket_sizes(model: torch.nn.Module) -> list[int]:
    """Bytes of each gradient bucket a DDP-wrapped `model` holds (none for any other module), after
    the rebuild its next forward would make.

    DDP rebuilds its buckets once, in the forward after the first backward, in C++ (the old ones are
    freed unseen); that rebuild runs here instead, as `DistributedDataParallel._pre_forward` runs it,
    so that the stand-ins stand for the buckets the measured steps hold. The reducer hands out only
    copies of its buckets (`_get_zeros_like_grad_buckets`); each copy has its bucket's size and is
    dropped at once.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return []
    if model.reducer._rebuild_buckets():
        model._has_rebuilt_buckets = True
    return [
        bucket.buffer().untyped_storage().nbytes() for bucket in model.reducer._get_zeros_like_grad_buckets()
    ]


class ResizingStorageTracker(LiveStorageTracker):
    """A `LiveStorageTracker` that counts each storage at its current size, so a storage resized
    outside any operator (FSDP2's unsharded parameters) counts from the next operator on, and that
    counts a wrapper subclass's inner tensors. `hold(size_bytes)` adds storages it cannot see (DDP's
    buckets). Reading every storage at every operator costs time linear in the live storages: for
    measuring small models in tests, not for profiling."""

    def __init__(self, counting: MemoryCounting | None = None) -> None:
        super().__init__(counting)
        self._storages: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        self._stand_in_sizes: list[int] = []
        self._inputs: set[int] = set()

    def hold(self, size_bytes: int) -> None:
        """Count a stand-in for a storage of `size_bytes` that exists but is not visible yet; the first
        storage of that size an operator writes into without creating it takes its place."""
        self._stand_in_sizes.append(size_bytes)
        self._add(self.counted(size_bytes), size_bytes)

    def _claim_stand_in(self, storage: torch.UntypedStorage, created: bool) -> None:
        if created or storage.nbytes() not in self._stand_in_sizes:
            return
        self._stand_in_sizes.remove(storage.nbytes())
        self._add(-self.counted(storage.nbytes()), -storage.nbytes())

    def _add(self, size_bytes: int, exact_bytes: int) -> None:
        self.live_bytes += size_bytes
        self.exact_live_bytes += exact_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.exact_peak_bytes = max(self.exact_peak_bytes, self.exact_live_bytes)

    def _register(self, tensor: torch.Tensor) -> None:
        for plain in local_tensors(tensor):
            storage = plain.untyped_storage()
            key = id(storage)
            if key in self._storages:
                continue
            self._claim_stand_in(storage, created=key not in self._inputs)
            self._storages[key] = (weakref.ref(storage), 0)
            self._resize(key, storage.nbytes())
            weakref.finalize(storage, self._forget, key)

    def _resize(self, key: int, exact_bytes: int) -> None:
        reference, old_exact_bytes = self._storages[key]
        if exact_bytes == old_exact_bytes:
            return
        self._storages[key] = (reference, exact_bytes)
        self._add(self._blocks(exact_bytes) - self._blocks(old_exact_bytes), exact_bytes - old_exact_bytes)

    def _blocks(self, exact_bytes: int) -> int:
        return self.counted(exact_bytes) if exact_bytes > 0 else 0

    def _forget(self, key: int) -> None:
        _, exact_bytes = self._storages.pop(key)
        self.live_bytes -= self._blocks(exact_bytes)
        self.exact_live_bytes -= exact_bytes

    def refresh(self) -> None:
        """Read every storage's current size (what was resized since the last operator)."""
        for key, (reference, _) in list(self._storages.items()):
            storage = reference()
            if storage is not None:
                self._resize(key, storage.nbytes())

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        return all(id(plain.untyped_storage()) in self._storages for plain in local_tensors(tensor))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.refresh()
        self._inputs = {
            id(plain.untyped_storage())
            for tensor in tensors_in((args, kwargs))
            for plain in local_tensors(tensor)
        }
        output = func(*args, **(kwargs or {}))
        for tensor in tensors_in(output):
            self._register(tensor)
        self._inputs = set()
        self.refresh()
        return output
