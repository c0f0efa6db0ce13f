"""NOTE [horizontal fusion] in planner/compiled/optimize.py: which horizontal fusions the planner refuses.

A refusal keeps a replay in the backward step the plan runs it in (GPT-2's two attention recomputes,
fused, ran at once: tests/planner/test_compiled.py measures that case). Refusing more than that costs
step time and no bytes (ResNet: 75 fusions refused, 2-3 % of its step), so the decision is checked
here on scheduler nodes reduced to what it reads: the FX operators each fused kernel computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

from planner.compiled.optimize import CompiledPlanning, _PlannedFusion


@dataclass(frozen=True)
class _Origin:
    name: str


@dataclass(frozen=True)
class _FxNode:
    origins: frozenset[_Origin]

    def get_origins(self) -> frozenset[_Origin]:
        return self.origins


@dataclass(frozen=True)
class _Part:
    node: _FxNode


@dataclass(frozen=True)
class _Kernel:
    """A fused scheduler node computing the FX operators `names`."""

    names: tuple[str, ...]

    def get_nodes(self) -> list[_Part]:
        return [_Part(_FxNode(frozenset(_Origin(name) for name in self.names)))]


@dataclass(frozen=True)
class _Graph:
    is_backward: bool


STEPS = {"relu_3": 2, "le_1": 2, "mul_7": 2, "relu_9": 5, "mm_4": 5, "sum_2": 9}
"""Backward operator -> the node whose backward step runs it; relu_3 and relu_9 replay the forward."""


def _fusion_allowed(node1: _Kernel, node2: _Kernel, *, backward: bool = True) -> bool:
    planning = CompiledPlanning(
        request=cast(Any, None), backward_steps=STEPS, replayed=frozenset({"relu_3", "relu_9"})
    )
    with V.set_graph_handler(_Graph(is_backward=backward)):  # type: ignore[arg-type]
        return _PlannedFusion(planning).can_fuse_horizontal(None, node1, node2, 0)


@pytest.fixture(autouse=True)
def inductor_would_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """inductor's own heuristics say yes to every pair: what is refused is the planner's refusal."""

    def always(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        return True

    monkeypatch.setattr(InductorChoices, "can_fuse_horizontal", staticmethod(always))


def test_a_replay_is_not_fused_with_a_kernel_of_another_step() -> None:
    assert not _fusion_allowed(_Kernel(("relu_3",)), _Kernel(("mm_4",)))
    assert not _fusion_allowed(_Kernel(("mul_7",)), _Kernel(("relu_9",)))
    assert not _fusion_allowed(_Kernel(("relu_3",)), _Kernel(("relu_9",)))


def test_kernels_that_start_in_the_same_step_fuse() -> None:
    """A kernel vertical fusion spread over steps 2 and 9 runs at step 2: fusing it with step 2's
    replay moves nothing."""
    assert _fusion_allowed(_Kernel(("le_1", "sum_2")), _Kernel(("relu_3",)))
    assert _fusion_allowed(_Kernel(("relu_3",)), _Kernel(("mul_7",)))


def test_kernels_of_different_steps_without_a_replay_fuse() -> None:
    """Gradient kernels fuse as inductor fuses them without a plan."""
    assert _fusion_allowed(_Kernel(("mul_7",)), _Kernel(("mm_4",)))


def test_the_forward_graph_is_inductors_own() -> None:
    assert _fusion_allowed(_Kernel(("relu_3",)), _Kernel(("mm_4",)), backward=False)
