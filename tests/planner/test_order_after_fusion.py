"""NOTE [order after fusion] in planner/compiled/backward_order.py: after inductor fuses a producer into a
far later consumer, every node keeps the place the graph gave it unless what it reads is not ready.

Checked here on scheduler nodes reduced to what the sort reads (their buffers, what they read, their
place in the graph); tests/planner/test_compiled_out_of_zoo.py measures the diffusers U-Net it fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from torch._inductor.scheduler import Scheduler

from planner.compiled.backward_order import in_planned_order


@dataclass(frozen=True)
class _Dep:
    name: str


@dataclass(eq=False)
class _Node:
    """A scheduler node writing `buffers`, reading `reads`, first placed at `min_order`."""

    name: str
    min_order: int
    reads: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    unmet_dependencies: set[_Dep] = field(init=False)

    def __post_init__(self) -> None:
        self.unmet_dependencies = {_Dep(name) for name in self.reads}
        self.buffers = self.buffers or (f"buf_{self.name}",)

    def get_buffer_names(self) -> tuple[str, ...]:
        return self.buffers


def _fused_time_embedding() -> list[_Node]:
    """The U-Net's case, in the order inductor sorts by (`min_order`): the first time-embedding gradient
    fused into the sum of them all, which takes the first one's place (0) and reads the blocks' (3, 4);
    a convolution's backward (1) that the first block reads, and the `getitem` of its weight gradient
    (2), which nothing reads."""
    return [
        _Node("fused_sum", 0, reads=("buf_block_a", "buf_block_b")),
        _Node("conv_backward", 1),
        _Node("weight_getitem", 2, reads=("buf_conv_backward",)),
        _Node("block_a", 3, reads=("buf_conv_backward",)),
        _Node("block_b", 4, reads=("buf_block_a",)),
    ]


def _names(nodes: list[_Node]) -> list[str]:
    return [node.name for node in nodes]


def test_a_node_the_fused_kernel_does_not_need_keeps_its_place() -> None:
    ordered = in_planned_order(_fused_time_embedding())  # type: ignore[arg-type]
    assert _names(ordered) == ["conv_backward", "weight_getitem", "block_a", "block_b", "fused_sum"]


def test_inductors_depth_first_sort_moved_it_after_the_fused_kernel() -> None:
    """What the planner's sort replaces: inductor's own put the getitem after the fused kernel and all
    it needs, which kept the convolution's whole result allocated until then."""
    ordered = Scheduler.topological_sort_schedule(None, _fused_time_embedding())  # type: ignore[arg-type]
    assert _names(ordered) == ["conv_backward", "block_a", "block_b", "fused_sum", "weight_getitem"]


def test_an_order_with_nothing_fused_is_kept() -> None:
    nodes = [
        _Node("a", 0),
        _Node("b", 1, reads=("buf_a",)),
        _Node("c", 2),
        _Node("d", 3, reads=("buf_c", "buf_b")),
    ]
    assert _names(in_planned_order(nodes)) == ["a", "b", "c", "d"]  # type: ignore[arg-type]


def test_a_cycle_is_refused() -> None:
    nodes = [_Node("a", 0, reads=("buf_b",)), _Node("b", 1, reads=("buf_a",))]
    with pytest.raises(AssertionError, match="DAG"):
        in_planned_order(nodes)  # type: ignore[arg-type]
