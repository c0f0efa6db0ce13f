"""NOTE [order after fusion] in planner/compiled/backward_order.py: after inductor fuses, each scheduler
node runs where the planned graph puts the last operator it computes, unless what it reads is not ready.

Checked here on scheduler nodes reduced to what the sort reads (their buffers, what they read, the
operators they compute, inductor's `min_order`); tests/planner/test_compiled_out_of_zoo.py measures the
diffusers U-Net this fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from torch._inductor.scheduler import Scheduler

from planner.compiled.backward_order import in_planned_order, planned_positions


@dataclass(frozen=True)
class _Dep:
    name: str


class _Operator(str):
    """An FX operator named as the planned graph names it; its target is its name."""

    @property
    def target(self) -> str:
        return str(self)


@dataclass(frozen=True)
class _Operators:
    names: tuple[str, ...]
    op_overload: str | None = None
    """The operator an extern kernel calls."""

    def get_origins(self) -> tuple[_Operator, ...]:
        return tuple(_Operator(name) for name in self.names)


@dataclass(frozen=True)
class _Part:
    node: _Operators | None


@dataclass(eq=False)
class _Node:
    """A scheduler node computing `operators` (its own name by default), reading the buffers of the
    nodes named in `reads`, made `min_order`-th by inductor."""

    name: str
    min_order: int
    reads: tuple[str, ...] = ()
    operators: tuple[str, ...] = ()
    extern: bool = False
    unmet_dependencies: set[_Dep] = field(init=False)

    def __post_init__(self) -> None:
        self.unmet_dependencies = {_Dep(f"buf_{name}") for name in self.reads}
        self.operators = self.operators or (self.name,)

    def get_buffer_names(self) -> tuple[str, ...]:
        return (f"buf_{self.name}",)

    def get_nodes(self) -> list[_Part]:
        return [_Part(_Operators(self.operators, self.name if self.extern else None))]

    def is_extern(self) -> bool:
        return self.extern


def _names(nodes: list[Any]) -> list[str]:
    return [node.name for node in nodes]


def _by_min_order(nodes: list[_Node]) -> list[Any]:
    return in_planned_order(nodes, {node: node.min_order for node in nodes})


def _fused_time_embedding() -> list[_Node]:
    """The U-Net's case, in inductor's order (`min_order`): the first time-embedding gradient fused into
    the sum of them all, which takes the first one's place (0) and reads the blocks' (3, 4); a
    convolution's backward (1) that the first block reads, and the `getitem` of its weight gradient (2),
    which nothing reads."""
    return [
        _Node("fused_sum", 0, reads=("block_a", "block_b")),
        _Node("conv_backward", 1),
        _Node("weight_getitem", 2, reads=("conv_backward",)),
        _Node("block_a", 3, reads=("conv_backward",)),
        _Node("block_b", 4, reads=("block_a",)),
    ]


def test_a_node_the_fused_kernel_does_not_need_keeps_its_place() -> None:
    ordered = _by_min_order(_fused_time_embedding())
    assert _names(ordered) == ["conv_backward", "weight_getitem", "block_a", "block_b", "fused_sum"]


def test_inductors_depth_first_sort_moved_it_after_the_fused_kernel() -> None:
    """What the planner's sort replaces: inductor's own put the getitem after the fused kernel and all
    it needs, which kept the convolution's whole result allocated until then."""
    ordered = Scheduler.topological_sort_schedule(None, _fused_time_embedding())  # type: ignore[arg-type]
    assert _names(ordered) == ["conv_backward", "block_a", "block_b", "fused_sum", "weight_getitem"]


def test_a_kernel_inductor_made_late_runs_where_its_operators_are_planned() -> None:
    """The CNN's case: a BatchNorm backward's pointwise tail, planned before a replay, is made only when
    the convolution backward after that replay reads it, so inductor numbered it after the replay."""
    planned = ["grad_scale", "bn_tail", "replay_conv", "replay_relu", "conv_backward"]
    nodes = [
        _Node("grad_scale", 0),
        _Node("replay_conv", 1),
        _Node("replay_relu", 2, reads=("replay_conv",)),
        _Node("bn_tail", 3, reads=("grad_scale",), operators=("grad_scale", "bn_tail")),
        _Node("conv_backward", 4, reads=("bn_tail", "replay_relu")),
    ]
    positions = planned_positions(nodes, planned)  # type: ignore[arg-type]
    assert positions[nodes[3]] == planned.index("bn_tail")
    assert _names(in_planned_order(nodes, positions)) == planned


def test_a_kernel_an_extern_kernel_realized_runs_where_its_own_operators_are_planned() -> None:
    """NOTE [realized inputs]: inductor names the convolution backward among the origins of the
    BatchNorm tail it realizes as that convolution's input; placed there, the tail ran after the
    replay that the convolution reads, and both were allocated at once."""
    planned = ["bn_reduce", "bn_tail", "replay_relu", "conv_backward"]
    nodes = [
        _Node("bn_reduce", 0),
        _Node("replay_relu", 1),
        _Node("bn_tail", 2, reads=("bn_reduce",), operators=("bn_tail", "conv_backward")),
        _Node(
            "conv_backward",
            3,
            reads=("bn_tail", "replay_relu"),
            operators=("bn_tail", "conv_backward"),
            extern=True,
        ),
    ]
    positions = planned_positions(nodes, planned)  # type: ignore[arg-type]
    assert positions[nodes[2]] == planned.index("bn_tail")
    assert _names(in_planned_order(nodes, positions)) == planned


def test_a_node_naming_no_planned_operator_keeps_the_place_of_the_one_before() -> None:
    nodes = [_Node("a", 0), _Node("unnamed", 1, operators=("not_in_graph",)), _Node("b", 2)]
    positions = planned_positions(nodes, ["a", "b"])  # type: ignore[arg-type]
    assert [positions[node] for node in nodes] == [0, 0, 1]


def test_an_order_with_nothing_fused_is_kept() -> None:
    nodes = [_Node("a", 0), _Node("b", 1, reads=("a",)), _Node("c", 2), _Node("d", 3, reads=("c", "b"))]
    assert _names(_by_min_order(nodes)) == ["a", "b", "c", "d"]


def test_a_cycle_is_refused() -> None:
    with pytest.raises(AssertionError, match="DAG"):
        _by_min_order([_Node("a", 0, reads=("b",)), _Node("b", 1, reads=("a",))])
