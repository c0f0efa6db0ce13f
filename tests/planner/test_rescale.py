"""Graph families (planner/sizing/rescale.py): a graph rescaled from three captures equals a fresh
capture, and what cannot be rescaled honestly is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import planner
from planner.ir import ActivationGraph
from planner.profiler.cost_model import device_spec
from planner.sizing.rescale import GraphFamily, NotRescalable

SPEC = device_spec("h100")


class ExplicitAttention(nn.Module):
    """One attention layer written out: its scores are sequence x sequence."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / 8.0, dim=-1)
        return self.out(weights @ v)


def _attention_graph(sequence: int, *, measured: bool = False) -> ActivationGraph:
    with torch.device("cpu" if measured else "meta"):
        model, x = ExplicitAttention(), torch.zeros(2, sequence, 32)
    costs = {"cost_model": "measured"} if measured else {"cost_model": "analytic", "device": "h100"}
    return planner.optimize(model, (x,), budget_bytes=2**40, solver="none", **costs).graph


def test_a_graph_rescaled_by_sequence_equals_a_fresh_capture_number_for_number() -> None:
    # The scores grow with the square of the sequence. tests/planner/test_capacity.py checks rescaling
    # by batch and by sequence on zoo models through planner.capacity.
    family = GraphFamily.fit({size: _attention_graph(size) for size in (16, 24, 32)}, SPEC)
    other = 72
    fresh = _attention_graph(other)
    assert max(fresh.storage_bytes.values()) >= 2 * other * other * 4
    assert family.mismatch(other, fresh) is None
    rescaled = family.graph_at(other)
    assert rescaled is not None and rescaled.storage_bytes == fresh.storage_bytes
    assert rescaled.static == fresh.static
    wrong = dataclasses.replace(
        fresh, storage_bytes={**fresh.storage_bytes, "s0": fresh.storage_bytes["s0"] + 1}
    )
    size_bytes = fresh.storage_bytes["s0"]
    assert (
        family.mismatch(other, wrong)
        == f"at {other}, storage s0: rescaled {size_bytes}, captured {size_bytes + 1}"
    )


def test_measured_times_and_different_graphs_are_not_rescaled() -> None:
    with pytest.raises(NotRescalable, match="measured times are not rescaled"):
        GraphFamily.fit(dict.fromkeys((16, 24, 32), _attention_graph(16, measured=True)), SPEC)
    graphs = {size: _attention_graph(size) for size in (16, 24, 32)}
    graphs[32] = dataclasses.replace(graphs[32], nodes=graphs[32].nodes[:-1])
    with pytest.raises(NotRescalable, match="node counts differ"):
        GraphFamily.fit(graphs, SPEC)


def test_a_size_where_a_byte_count_would_be_fractional_gets_no_graph() -> None:
    base = _attention_graph(16)
    # s0 holds 0, 0 and 1 bytes at sizes 2, 4 and 6: the quadratic through them is (b - 2)(b - 4) / 8,
    # -1/8 of a byte at b = 3 (no graph there) and 3 bytes at b = 8.
    graphs = {
        size: dataclasses.replace(base, storage_bytes={**base.storage_bytes, "s0": value})
        for size, value in ((2, 0), (4, 0), (6, 1))
    }
    family = GraphFamily.fit(graphs, SPEC)
    assert family.graph_at(3) is None
    rescaled = family.graph_at(8)
    assert rescaled is not None and rescaled.storage_bytes["s0"] == 3


def _with_point(graph: ActivationGraph, workspace_bytes: int, freed: tuple[str, ...]) -> ActivationGraph:
    nodes = list(graph.nodes)
    nodes[1] = dataclasses.replace(nodes[1], backward_points=((workspace_bytes, freed),))
    return dataclasses.replace(graph, nodes=tuple(nodes))


def test_the_workspaces_of_backward_points_rescale_and_what_they_free_must_not_change() -> None:
    """A node freed part way (NOTE [freed part way in eager backward], issue 35) rescales its points'
    workspaces like any number; a point that frees other storages at another size is refused."""
    base = _attention_graph(16)
    freed = (next(iter(base.storage_bytes)),)
    graphs = {size: _with_point(base, 512 * size, freed) for size in (16, 24, 32)}
    family = GraphFamily.fit(graphs, SPEC)
    rescaled = family.graph_at(40)
    assert rescaled is not None and rescaled.nodes[1].backward_points == ((512 * 40, freed),)
    assert family.mismatch(40, _with_point(base, 512 * 40 + 1, freed)) == (
        f"at 40, node {base.nodes[1].name} backward_points[0]: rescaled {512 * 40}, captured {512 * 40 + 1}"
    )
    graphs[32] = _with_point(base, 512 * 32, ())
    with pytest.raises(NotRescalable, match="differs in backward_points"):
        GraphFamily.fit(graphs, SPEC)
