"""Tensors a forward makes from Python values are made each step by the captured module, as by the model
(NOTE [factories while tracing] in planner/capture/factories.py). Before, FX folded them into constants:
zoo_dag's diffusion U-Net held its timestep frequencies for the module's life (512 bytes its eager
model never holds, in every prediction), and noise drawn with `torch.randn` was drawn once, at capture."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import planner
from planner.capture.chain import capture
from planner.ir import Region, RegionPolicy, Schedule
from planner.profiler.static_memory import constant_bytes
from planner.testing.steps import assert_same_step, one_step

BATCH, WIDTH, HALF = 8, 32, 16


class TimestepFrequencies(nn.Module):
    """Two Linear layers conditioned on a diffusion timestep's sinusoidal embedding, whose frequencies
    come from `torch.arange` of a Python int, as DDPM's do."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.time = nn.Linear(2 * HALF, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        frequencies = torch.exp(-math.log(10000.0) * torch.arange(HALF, dtype=torch.float32) / HALF)
        angles = timesteps.float()[:, None] * frequencies[None]
        embedding = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        return self.second(torch.relu(self.first(x) + self.time(embedding)))


class NoisyLayers(nn.Module):
    """Two Linear layers with multiplicative Gaussian noise between them, drawn in the forward: the
    backward reads the noise, so a replay that drew other numbers would change the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        return self.second(hidden * (1 + 0.5 * torch.randn(BATCH, WIDTH)))


class SteeredByAFactory(nn.Module):
    """Branches in Python on a tensor made from Python values: only a folded constant can steer it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.ones(2).sum() > 1:
            return torch.relu(self.linear(x))
        return self.linear(x)


class SkipsAtRandom(nn.Module):
    """A layer that skips itself at random (stochastic depth by skipping, or one layer of LayerDrop)."""

    def __init__(self, probability: float) -> None:
        super().__init__()
        self.probability = probability
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and float(torch.rand(())) < self.probability:
            return x
        return torch.relu(self.linear(x))


class LayerDropStack(nn.Module):
    """Four layers, each skipped at random by the stack's own forward (LayerDrop) or by itself, and a head."""

    def __init__(self, *, in_root: bool) -> None:
        super().__init__()
        self.in_root = in_root
        self.layers = nn.ModuleList(SkipsAtRandom(0.0 if in_root else 0.5) for _ in range(4))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.in_root and self.training and float(torch.rand(())) < 0.5:
                continue
            x = layer(x)
        return self.head(x).square().mean()


def _frequencies_call() -> tuple[TimestepFrequencies, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    timesteps = torch.randint(0, 1000, (BATCH,), generator=generator)
    return TimestepFrequencies(), (torch.randn(BATCH, WIDTH, generator=generator), timesteps)


def test_frequencies_made_from_a_python_int_are_made_each_step_not_held() -> None:
    model, inputs = _frequencies_call()
    captured = capture(model, inputs, {})
    assert captured.path == "fx"
    assert constant_bytes(captured.graph_module, model) == 0
    assert captured.graph_module.graph.find_nodes(op="call_function", target=torch.arange)
    plan = planner.optimize(model, inputs, budget_gb=1)
    assert plan.module is not None
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs))
    original_bytes = planner.measure(_frequencies_call()[0], inputs).peak_bytes
    planned_bytes = planner.measure(plan.module, inputs).peak_bytes
    assert planned_bytes == original_bytes == plan.simulation.peak_bytes, plan.summary()


def test_noise_drawn_in_the_forward_is_drawn_each_step_as_the_model_draws_it() -> None:
    """Without checkpointing, and with the draw inside a checkpointed region, whose replay draws the
    same numbers again."""
    model = NoisyLayers()
    inputs = (torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)),)
    plan = planner.optimize(model, inputs, budget_gb=1)
    assert plan.module is not None and plan.profile is not None
    names = [node.name for node in plan.graph.nodes]
    assert "randn" in names, names
    start, stop = names.index("tanh"), names.index("second")
    assert start < names.index("randn") < stop, names
    around_the_draw = Schedule(
        regions=(
            Region(0, start, RegionPolicy.STORE),
            Region(start, stop, RegionPolicy.CHECKPOINT),
            Region(stop, len(names), RegionPolicy.STORE),
        ),
        solver="test",
    )
    checkpointed = plan.profile.rewrite(around_the_draw)
    for seed in (1, 5):
        expected = one_step(model, inputs, seed=seed)
        assert_same_step(expected, one_step(plan.module, inputs, seed=seed))
        assert_same_step(expected, one_step(checkpointed, inputs, seed=seed))


def test_a_factory_that_steers_python_control_flow_is_folded_as_before() -> None:
    model = SteeredByAFactory()
    inputs = (torch.randn(BATCH, WIDTH),)
    captured = capture(model, inputs, {})
    assert captured.path == "fx"
    assert captured.opaque_modules == ()
    assert captured.graph_module.graph.find_nodes(op="call_function", target=torch.relu)


def test_a_random_draw_that_steers_python_control_flow_is_never_folded() -> None:
    """NOTE [random control flow] in planner/capture/factories.py: folded, LayerDrop's draw was made once,
    at capture, and `plan.module` never ran one layer and always ran the others (one loss under every
    seed where the model gave seven). A layer that skips itself stays opaque, drawn each step: the
    planned module trains as the model under every seed. A root forward that skips layers is refused,
    saying so and how to turn it off."""
    torch.manual_seed(0)
    model, inputs = LayerDropStack(in_root=False), (torch.randn(BATCH, WIDTH),)
    captured = capture(model, inputs, {})
    assert len(captured.opaque_modules) == 4, captured.opaque_modules
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    assert plan.module is not None
    steps = [one_step(plan.module, inputs, seed=seed) for seed in range(6)]
    for seed, step in enumerate(steps):
        assert_same_step(one_step(model, inputs, seed=seed), step)
    assert len({step.loss.item() for step in steps}) > 1, "the same layers ran under every seed"
    with pytest.raises(planner.UnsupportedModel, match="layerdrop = 0.0"):
        planner.optimize(LayerDropStack(in_root=True), inputs, budget_bytes=2**40)
