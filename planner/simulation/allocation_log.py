"""A simulated step's allocations and frees in order, for the model of CUDA's caching allocator.

Why it exists: how many bytes are live at once (step.py) says nothing about how the caching allocator
places them; reserved memory depends on the order and size of every allocation and free. The
simulator records them here as it replays a schedule (`simulate(..., log=...)`), and reserved.py runs
the record through allocator.py.
"""

from __future__ import annotations

from planner.simulation.allocator import AllocatorEvent

__all__ = ["REPLAY_SUFFIX", "AllocationLog"]


REPLAY_SUFFIX = "@replay"
"""Appended to a storage's name for its copy made again by a replay."""


class AllocationLog:
    """A simulated step's allocations and frees in order, one per storage, for the caching allocator
    model (allocator.py): what a schedule asks of the device, not only how much at once.

    A storage already live is not allocated again (a stored activation passes from forward to
    backward); a workspace is one allocation made and freed at its node, on top of what is live there.
    """

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.events: list[AllocatorEvent] = []
        self.live: set[str] = set()
        self._transients = 0

    def malloc(self, name: str, size_bytes: int | None = None) -> None:
        """Allocate `name` (of its storage's size unless given), unless it is live or empty."""
        if name in self.live:
            return
        size = self.sizes[name.removesuffix(REPLAY_SUFFIX)] if size_bytes is None else size_bytes
        if size > 0:
            self.live.add(name)
            self.events.append(("malloc", name, size))

    def free(self, name: str) -> None:
        if name in self.live:
            self.live.discard(name)
            self.events.append(("free", name))

    def transient(self, what: str, size_bytes: int) -> None:
        """A workspace of `size_bytes` made and freed at once, beside everything live."""
        self._transients += 1
        name = f"{what}#{self._transients}"
        self.malloc(name, size_bytes)
        self.free(name)

    def free_all(self, *, keep: frozenset[str] = frozenset()) -> None:
        """Free everything live but `keep` (the end of a step)."""
        for name in sorted(self.live - keep):
            self.free(name)
