"""NOTE [step constants] in planner/compiled/groups.py: values of the compiled step that depend on no
gradient (a causal mask compared from positions, a cos table) are materialised once in a front node
that is never checkpointed, so no plan rebuilds them inside recomputed kernels; fills stay inlined.

The model is written for this test, the way transformers builds a mask and rotary tables in the
forward, not taken from the zoo: positions from `arange`, a boolean causal mask from a comparison, a
cos table, and a zeros fill that inductor inlines for free. A frozen first layer is a step constant
too: its output joins the front node, and nothing after it does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import planner
from planner.compiled.groups import SEEDS_NODE
from planner.compiled.optimize import plan_compiled_step
from planner.ir import ActivationGraph, MemoryCounting, TrainingStep
from planner.profiler.interpreter import LOSS_NODE
from planner.profiler.measurement import default_loss
from planner.simulation.step import held_storages

SEQUENCE = 24
WIDTH = 16
BATCH = 3
SEED = 7
GRADIENT_RTOL = 1e-4
PREDICTION_TOLERANCE = 0.05
HUGE_BUDGET_BYTES = 2**40
BLOCKS = MemoryCounting.BLOCKS


class _MaskedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(WIDTH, WIDTH)
        self.key = nn.Linear(WIDTH, WIDTH)
        self.value = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor, table: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        scores = (self.query(hidden) * table) @ (self.key(hidden) * table).transpose(1, 2) + bias
        weights = torch.softmax(scores.masked_fill(mask, float("-inf")) / math.sqrt(WIDTH), dim=-1)
        hidden = hidden + nn.functional.dropout(weights, 0.1, self.training) @ self.value(hidden)
        return hidden + self.out(hidden)


class _PositionalModel(nn.Module):
    """Embedding, then three layers reading one mask, one cos table and one zeros bias built here."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(64, WIDTH)
        self.layers = nn.ModuleList(_MaskedLayer() for _ in range(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        mask = positions[None, :] > positions[:, None]
        table = torch.cos(positions[:, None] * torch.arange(1, WIDTH + 1) / WIDTH)
        bias = torch.zeros(tokens.shape[1], tokens.shape[1])
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = layer(hidden, mask, table, bias)
        return hidden


def _model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return _PositionalModel(), (torch.randint(64, (BATCH, SEQUENCE)),)


def _graph(model: nn.Module, inputs: tuple[torch.Tensor, ...], budget_bytes: int) -> planner.Plan:
    return plan_compiled_step(
        model, inputs, {}, budget_bytes=budget_bytes, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="dp", device=None,
    )  # fmt: skip


def _constant_bytes(graph: ActivationGraph, index: int) -> int:
    """Bytes node `index` creates other than dropout's seeds (NOTE [random operators])."""
    return sum(
        graph.storage_bytes[name] for name in graph.nodes[index].creates if not name.startswith(SEEDS_NODE)
    )


def test_a_mask_and_a_table_are_materialised_once_in_a_node_never_checkpointed() -> None:
    model, inputs = _model()
    graph = _graph(model, inputs, HUGE_BUDGET_BYTES).graph
    front = graph.nodes[0]
    assert not front.checkpointable, front
    mask_bytes = BLOCKS.of(SEQUENCE * SEQUENCE)  # bool, in 512-byte blocks as the graph counts
    table_bytes = BLOCKS.of(SEQUENCE * WIDTH * 4)  # float32
    # the zeros bias is a fill: inlined for free, not in the front node
    assert _constant_bytes(graph, 0) == mask_bytes + table_bytes, front
    pinned = [node.name for node in graph.nodes if not node.checkpointable]
    assert pinned == [front.name, LOSS_NODE], pinned


def test_a_plan_that_recomputes_a_layer_reading_the_mask_trains_as_torch_compile() -> None:
    model, inputs = _model()
    reference = _graph(model, inputs, HUGE_BUDGET_BYTES)
    budget = int(reference.min_peak_bytes + 0.1 * (reference.baseline_peak_bytes - reference.min_peak_bytes))
    plan = planner.optimize(model, inputs, budget_bytes=budget, compile=True)
    assert plan.module is not None and plan.compiled is not None
    constants = set(plan.graph.nodes[0].creates)
    holding = [
        region for region in plan.schedule.checkpointed if constants & set(held_storages(plan.graph, region))
    ]
    assert holding, (
        f"no checkpointed region reads the mask or the table: the test means nothing\n{plan.summary()}"
    )

    torch.manual_seed(SEED)
    expected_loss = default_loss(torch.compile(model)(*inputs))
    expected = torch.cat([g.flatten() for g in torch.autograd.grad(expected_loss, list(model.parameters()))])
    torch.manual_seed(SEED)
    loss = default_loss(plan.module(*inputs))
    gradients = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])
    torch.testing.assert_close(loss, expected_loss, rtol=GRADIENT_RTOL, atol=0.0)
    assert ((gradients - expected).norm() / expected.norm()).item() <= GRADIENT_RTOL

    measured = plan.compiled.measured_peak_bytes
    assert measured is not None and measured <= budget, plan.summary()
    assert abs(plan.predicted_peak_bytes - measured) <= PREDICTION_TOLERANCE * measured, plan.summary()


def test_a_frozen_first_layer_joins_the_front_node_and_the_layers_after_it_do_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH), nn.Tanh())
    model[0].requires_grad_(False)
    inputs = (torch.randn(BATCH, WIDTH),)
    graph = _graph(model, inputs, HUGE_BUDGET_BYTES).graph
    front = graph.nodes[0]
    assert not front.checkpointable, front
    # the frozen Linear's output (an extern kernel's) and its ReLU, which the next Linear reads
    assert _constant_bytes(graph, 0) == 2 * BLOCKS.of(BATCH * 4 * WIDTH * 4), front
    assert all(node.checkpointable for node in graph.nodes[1:-1]), graph.nodes
