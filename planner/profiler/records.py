"""What a profiling step records about each node, and the instruments it records with.

Why it exists: the profiling step (interpreter.py) runs the captured graph node by node, and a call the
capture could not follow runs as parts (split_calls.py); both describe what they ran with the same
record, name activation storages with the same tracker and count FLOPs and operators with the same
meters, so the activation graph's nodes mean the same whichever way they were profiled.

NOTE [library workspaces]: on a GPU, cuDNN's convolutions and cuBLAS's matrix products take workspace
from PyTorch's caching allocator for the length of one kernel; no tensor holds it, so the live-storage
tracker never sees it, yet it counts in `max_memory_allocated` and in the peak. The first `make
gpu-check` on an H100 measured convolutional and MLP zoo models 2 to 10 MB above their prediction that
way while transformers matched within 0.7 %. On CUDA the tracker therefore also reads the allocator's
own peak over each node's forward and backward, and what rose beyond the storages it saw becomes that
node's workspace (`calibrate_workspace` in calibration.py). Other devices have no such allocator, and
their kernels take no hidden workspace from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from planner.capture.kept_whole import generator_states
from planner.ir import MemoryCounting
from planner.profiler.counting import LiveStorageTracker, storage_of, tensors_in
from planner.profiler.selective_cost import OperatorCounter, saved_when_kept

__all__ = [
    "RANDOM_FUNCTIONS",
    "RANDOM_MODULES",
    "Meters",
    "NodeRecord",
    "ProfilingTracker",
    "ReleasedOnUnpack",
    "UnpackedAgain",
    "free_dead_values",
    "forbid_replaying_mutated_inputs",
    "moved_bytes",
]

RANDOM_MODULES = (torch.nn.modules.dropout._DropoutNd,)
RANDOM_FUNCTIONS = {
    torch.nn.functional.dropout,
    torch.nn.functional.dropout1d,
    torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d,
    torch.nn.functional.alpha_dropout,
    torch.bernoulli,
    torch.rand,
    torch.randn,
    torch.rand_like,
    torch.randn_like,
}


@dataclass
class NodeRecord:
    """What the measuring step learned about one node."""

    name: str
    op: str
    module_path: str
    inputs: tuple[str, ...]
    creates: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)
    saves_anything: bool = False
    forward_peak_bytes: int = 0
    backward_peak_bytes: int | None = None
    unpack_live_bytes: int | None = None
    """Live bytes when the node's backward first unpacks a saved tensor (where a replay would run)."""
    last_pack_peak_bytes: int | None = None
    """The node's forward peak up to its last save: where a replay it triggers stops (NOTE [early stop])."""
    released_backward_peak_bytes: int | None = None
    """The node's backward peak in a second step that frees each saved tensor once its backward formula
    is done with it, as checkpoint frees a replay's (NOTE [replay's early frees] in calibration.py);
    None where that step did not run."""
    parameter_gradient_bytes: int = 0
    keep_cache_bytes: int = 0
    buffer_bytes: int = 0
    forward_flops: int = 0
    moved_bytes: int = 0
    operator_count: int = 1
    random: bool = False
    draws_python: bool = False
    stateful: bool = False
    in_place: bool = False
    checkpointable: bool = True
    part_of: str = ""
    mutates: list[str] = field(default_factory=list)
    """Activation storages among the node's inputs that it wrote in place (their version moved)."""


class ProfilingTracker(LiveStorageTracker):
    """A storage tracker that also names activation storages and remembers which are new."""

    def __init__(self) -> None:
        super().__init__()
        self.static_keys: set[int] = set()
        self.names: dict[int, str] = {}
        self.storage_bytes: dict[str, int] = {}
        self.new_since_mark: list[weakref.ref[torch.UntypedStorage]] = []
        self.allocated_since_mark_bytes = 0
        self.keep_cache_since_mark_bytes = 0
        """Of those, what a selective policy would cache (`saved_when_kept` operators' outputs)."""
        self.replayed_names: set[str] = set()
        """Activation storages made by operators a selective policy replays rather than caches (casts)."""
        self._operator_cached: bool | None = None
        """While an operator runs, whether a keep would cache its outputs; None outside operators."""
        self._replayed_keys: set[int] = set()
        self.on_free: Callable[[str], None] | None = None
        """Called with a named storage's name when it is freed (set while a split call runs)."""
        self.cuda_device: torch.device | None = None
        """The CUDA device the profiled step runs on, whose allocator `library_workspace_bytes` reads."""
        self._allocator_bytes_at_reset = 0
        self._live_bytes_at_reset = 0

    def reset_peak(self) -> None:
        super().reset_peak()
        if self.cuda_device is not None:
            self._allocator_bytes_at_reset = self._allocator_bytes("current")
            self._live_bytes_at_reset = self.live_bytes
            torch.cuda.reset_peak_memory_stats(self.cuda_device)

    def library_workspace_bytes(self) -> int:
        """Bytes the CUDA allocator handed out since `reset_peak` beyond the rise of the storages this
        tracker saw: the workspaces cuDNN and cuBLAS allocate inside one operator, which no tensor
        holds and no dispatch mode sees (NOTE [library workspaces]). 0 off CUDA."""
        if self.cuda_device is None:
            return 0
        allocator_rise = self._allocator_bytes("peak") - self._allocator_bytes_at_reset
        return max(0, allocator_rise - (self.peak_bytes - self._live_bytes_at_reset))

    def _allocator_bytes(self, which: str) -> int:
        """The allocator's allocated bytes (blocks) or, for exact counting, its requested bytes."""
        kind = "allocated_bytes" if self.counting is MemoryCounting.BLOCKS else "requested_bytes"
        return int(torch.cuda.memory_stats(self.cuda_device)[f"{kind}.all.{which}"])

    def _register(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        fresh = id(storage) not in self._tracked and storage.nbytes() > 0
        super()._register(tensor)
        if fresh:
            self.new_since_mark.append(weakref.ref(storage))
            self.allocated_since_mark_bytes += storage.nbytes()  # bytes moved, for the cost model: exact
            if self._operator_cached:
                self.keep_cache_since_mark_bytes += self.counted(storage.nbytes())
            elif self._operator_cached is not None:
                key = id(storage)
                self._replayed_keys.add(key)
                weakref.finalize(storage, self._replayed_keys.discard, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._operator_cached = saved_when_kept(func)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._operator_cached = None

    def name_of(self, tensor: torch.Tensor, *, create: bool) -> str | None:
        """Name of an activation storage (None for static ones); `create` names a new storage."""
        return self.name_of_storage(storage_of(tensor), create=create)

    def name_of_storage(self, storage: torch.UntypedStorage, *, create: bool) -> str | None:
        key = id(storage)
        if key in self.static_keys or storage.nbytes() == 0:
            return None
        if key not in self.names:
            if not create:
                return None
            name = f"s{len(self.storage_bytes)}"
            self.names[key] = name
            if key in self._replayed_keys:
                self.replayed_names.add(name)
            self.storage_bytes[name] = self.counted(storage.nbytes())
            weakref.finalize(storage, self._forget, key)
        return self.names[key]

    def _forget(self, key: int) -> None:
        name = self.names.pop(key, None)
        if name is not None and self.on_free is not None:
            self.on_free(name)

    def fresh_storages(self) -> list[torch.UntypedStorage]:
        """Storages registered since the last call that are still alive."""
        alive = [storage for ref in self.new_since_mark if (storage := ref()) is not None]
        self.new_since_mark = []
        self.allocated_since_mark_bytes = 0
        self.keep_cache_since_mark_bytes = 0
        return alive


class _GlobalCountsOnly:
    """Stands in for `FlopCounterMode`'s `ModuleTracker` (NOTE [global FLOPs])."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalCountsOnly:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None


def _flop_counter() -> FlopCounterMode:
    """NOTE [global FLOPs]: `FlopCounterMode` attributes FLOPs to modules with a `ModuleTracker`, whose
    module hooks register a gradient hook on every tensor a module gets; on a tensor that requires grad
    without a grad_fn (Reformer's reversible layers make them inside their custom autograd Function) it
    raises `AssertionError: Expected gradient function to be set`, and profiling Reformer crashed. The
    planner reads only the global total, which the counter keeps under "Global" whatever the tracker."""
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _GlobalCountsOnly()  # type: ignore[assignment]
    return counter


class Meters:
    """FLOPs, dispatched operators and random draws of the code run under it, charged to one node after
    another (a node that draws is `random`, whatever its code: a split call's glue calling dropout; one
    that moves Python's or NumPy's global generator `draws_python`)."""

    def __init__(self, *, counting: bool) -> None:
        self.flops = _flop_counter() if counting else None
        self.operators = OperatorCounter()
        self.charged_flops = 0
        self.charged_operators = 0
        self.charged_random = 0
        self.charged_generators: dict[str, Any] = {}
        self._stack = ExitStack()

    def __enter__(self) -> Meters:
        if self.flops is not None:
            self._stack.enter_context(self.flops)
            self._stack.enter_context(self.operators)
            self.charged_generators = generator_states()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()

    def charge(
        self, record: NodeRecord, inputs: Any, output: Any, *, glue_moved_bytes: int | None = None
    ) -> None:
        """Give `record` what ran since the last charge. Bytes moved are its inputs' and outputs', or
        `glue_moved_bytes` where there is no such call (a split call's glue)."""
        if self.flops is None:
            return
        flops, operators = self.flops.get_total_flops(), self.operators.count
        record.forward_flops = flops - self.charged_flops
        record.operator_count = max(1, operators - self.charged_operators)
        record.random = record.random or self.operators.random_count > self.charged_random
        generators = generator_states()
        record.draws_python = record.draws_python or generators != self.charged_generators
        record.moved_bytes = moved_bytes(inputs, output) if glue_moved_bytes is None else glue_moved_bytes
        self.charged_flops, self.charged_operators = flops, operators
        self.charged_random = self.operators.random_count
        self.charged_generators = generators


def _tensor_bytes(value: Any) -> int:
    """Bytes a node reads or writes: each tensor's own elements, views included."""
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def moved_bytes(inputs: Any, output: Any) -> int:
    """Bytes a node reads and writes; none when every output is a view of an input (a view moves
    metadata only). Views are recognised by their base, which works on the meta device too."""
    bases = {id(t._base if t._base is not None else t) for t in tensors_in(inputs)}
    outputs = tensors_in(output)
    if outputs and all(t._base is not None and id(t._base) in bases for t in outputs):
        return 0
    return _tensor_bytes(inputs) + _tensor_bytes(output)


class UnpackedAgain(RuntimeError):
    """A backward unpacked a saved tensor again after its first unpack's user had freed it."""


class ReleasedOnUnpack:
    """A saved tensor held as non-reentrant checkpoint holds its replay's tensors: until autograd first
    unpacks it, then only by the backward formula using it (NOTE [replay's early frees] in
    calibration.py)."""

    __slots__ = ("tensor", "unpacked")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.unpacked: weakref.ref[torch.Tensor] | None = None

    def take(self) -> torch.Tensor:
        if self.tensor is not None:
            first, self.tensor = self.tensor, None
            self.unpacked = weakref.ref(first)
            return first
        again = self.unpacked() if self.unpacked is not None else None
        if again is None:
            raise UnpackedAgain("a backward unpacked a saved tensor again after freeing it")
        return again


def forbid_replaying_mutated_inputs(records: list[NodeRecord]) -> None:
    """Mark not checkpointable every node that reads a storage before an in-place write to it.

    A checkpointed region keeps its input storages to replay itself, and refuses to replay from one
    that was written in place since (autograd's version check). A region that starts after storage
    S was made and contains a node reading S has S as an input; if S is written at or after that
    node, the replay fails. So every reader of S between S's creator (exclusive) and its last
    in-place writer (inclusive) stays out of checkpointed regions. capture/in_place.py runs the common
    in-place ops out of place where that is safe, so this rarely applies.
    """
    created_at = {storage: index for index, record in enumerate(records) for storage in record.creates}
    for writer_index, writer in enumerate(records):
        for storage in writer.mutates:
            start = created_at.get(storage, -1) + 1
            for record in records[start : writer_index + 1]:
                if storage in record.reads or storage in record.saves:
                    record.checkpointable = False


def free_dead_values(interpreter: fx.Interpreter) -> None:
    """Have `interpreter` free each value no node reads right after making it, as a GraphModule's code
    does.

    NOTE [dead values]: a captured graph can hold operators whose outputs nothing reads (Hugging Face's
    mask builders leave `unsqueeze` views of an `arange` behind; a slice assignment is a `copy_` whose
    output, a view, holds the whole tensor). The code a GraphModule generates frees such a value at
    once, but `fx.Interpreter` frees a value only after its last reader, so it held each to the end of
    the profiling step, and every later node's forward peak measured those storages as its own
    workspace. Replays count a node's forward workspace: zoo_real's T5 was predicted up to 5,632 bytes
    above the measurement of its decoder layers checkpointed one by one (ten blocks of views of masks'
    `arange`s), and the zoo's inplace_mlp 1.5 MB above with every `up` projection checkpointed."""
    for node in interpreter.graph.nodes:
        if not node.users and node.op != "output":
            interpreter.user_to_last_uses.setdefault(node, []).append(node)
