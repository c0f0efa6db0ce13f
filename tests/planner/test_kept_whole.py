"""What a trace would change about training is kept whole (planner/capture/kept_whole.py): a custom
autograd Function keeps its own backward in `plan.module` (NOTE [custom autograd functions]), operators
a forward runs under `torch.no_grad()` stay without gradients and under its own autocast in its dtype
(NOTE [grad mode while tracing]), a hook a forward registers on a tensor still runs (NOTE [tensor
hooks]), a loss a forward stores on its module is stored in every step (NOTE [stored on the module]),
a Function whose backward reads `ctx.saved_tensors` twice is never checkpointed, which
non-reentrant checkpoint refuses (NOTE [unpacked twice] in planner/profiler/interpreter.py), and a
forward that draws from Python's generator draws each step (NOTE [Python draws]), the same draw in a
checkpoint's replay (NOTE [Python draws replayed] in planner/rewrite/emit.py).

Before, FX traced a gradient reversal's forward (a view) into the graph, and `plan.module` trained the
Linear before it with the opposite gradient, without any checkpointing; FX recorded the operators under
`no_grad` without the switch, and gradients flowed through them; export dropped a tensor hook; FX
left a Proxy where a block stored its auxiliary loss; and a plan checkpointing the block that reads its
saved tensors twice raised `CheckpointError` in its first backward. A forward that takes a gradient of
its own made `optimize` fail, as capture and profiling ran it under `no_grad`. A layer skipped by
`random.random()` was skipped, or run, for good; kept whole, it was split when the profile's probes
drew alike, and checkpointed, its replay drew again (CheckpointError, or other gradients).
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from random import random as bound_draw
from typing import Any

import pytest
import torch
from torch import nn

import planner
from planner.ir import GLUE_OP, Region, RegionPolicy, Schedule
from planner.testing.steps import Variant, assert_same_step, one_step
from planner.testing.zoo_real import transformers_module

WIDTH = 64
ROWS = 1024
COMPILED_RTOL = 1e-4
"""Inductor's kernels sum in another order than eager's."""


class ReversedGradient(torch.autograd.Function):
    """The identity forward, the negated gradient backward (domain-adversarial training's layer)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class ReadsSavedTwice(torch.autograd.Function):
    """`x @ w` whose backward reads `ctx.saved_tensors` once per gradient it makes."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _, w = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_x = grad @ w.t()
        x, _ = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad_x, x.t() @ grad


class Reversal(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ReversedGradient.apply(x)


class TwiceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(ReadsSavedTwice.apply(x, self.weight))


class ScaledWithoutGradient(nn.Module):
    """Divides by a scale it computes under `no_grad`, as normalisations by a running figure do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.linear(x).abs().mean()
        return self.linear(x) / (scale + 1)


class HalvedGradient(nn.Module):
    """A Linear and ReLU whose output's gradient a tensor hook halves, registered in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.linear(x))
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: grad * 0.5)
        return hidden


class GradientPenalty(nn.Module):
    """A critic's score plus the squared norm of its gradient by its input, taken in the forward with
    `torch.autograd.grad` (WGAN-GP's penalty, a physics-informed loss's derivative)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.score = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score = self.score(torch.tanh(self.hidden(x)))
        (gradient,) = torch.autograd.grad(score.sum(), x, create_graph=True)
        return score + gradient.pow(2).sum(dim=1, keepdim=True)


class AuxiliaryLoss(nn.Module):
    """A Linear and ReLU that store a loss of their activations on themselves for the training loop to
    add, as mixtures of experts store their load-balancing loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        self.aux_loss = hidden.pow(2).mean()
        return torch.relu(hidden)


class Float32Head(nn.Module):
    """A log-softmax head computed in float32 with autocast switched off, as loss heads are."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return torch.log_softmax(self.linear(x.float()), dim=-1)


def mlp_block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())


class ReversedInTheRoot(nn.Module):
    """Applies the reversal in its own forward: neither FX nor export may capture the root."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = mlp_block(), mlp_block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(ReversedGradient.apply(self.first(x)))


class ScaledInTheRoot(nn.Module):
    """`ScaledWithoutGradient`'s switch in the root's own forward: FX may not capture it, export may."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = mlp_block(), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        with torch.no_grad():
            scale = self.second(hidden).abs().mean()
        return self.second(hidden) / (scale + 1)


def example(model: nn.Module) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return model, (torch.randn(ROWS, WIDTH),)


def planned_training_as_the_model(model: nn.Module, inputs: tuple[torch.Tensor]) -> planner.Plan:
    """The plan without budget pressure, whose module trains as `model` does."""
    plan = planner.optimize(model, inputs, budget_gb=1)
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs))
    return plan


def assert_lowest_trains_as_the_model(
    plan: planner.Plan, model: nn.Module, inputs: tuple[torch.Tensor]
) -> None:
    """The plan at the lowest peak checkpoints something and trains as `model` does."""
    lowest = plan.replan(budget_bytes=plan.min_peak_bytes)
    assert lowest.schedule.checkpointed, lowest.summary()
    assert_same_step(one_step(model, inputs), one_step(lowest.module, inputs))


@pytest.mark.parametrize(
    ("block", "capture"),
    [
        (Reversal, "fx (opaque: 1)"),
        (ScaledWithoutGradient, "fx (exported: 1)"),  # export records the switch FX refused
        (HalvedGradient, "fx (planned by children: 1)"),  # its own code runs as written
    ],
)
def test_a_submodule_a_trace_would_change_trains_as_the_model_with_and_without_checkpoints(
    block: type[nn.Module], capture: str
) -> None:
    model, inputs = example(nn.Sequential(mlp_block(), block(), mlp_block(), mlp_block()))
    plan = planned_training_as_the_model(model, inputs)
    assert plan.capture == capture, plan.capture
    assert_lowest_trains_as_the_model(plan, model, inputs)


def test_a_gradient_reversal_in_the_root_is_planned_by_submodules() -> None:
    model, inputs = example(ReversedInTheRoot())
    assert planned_training_as_the_model(model, inputs).capture == "module"


def test_a_block_whose_backward_unpacks_twice_is_not_checkpointed() -> None:
    blocks = [block for _ in range(3) for block in (TwiceBlock(), mlp_block())]
    model, inputs = example(nn.Sequential(*blocks))
    plan = planned_training_as_the_model(model, inputs)
    twice = [node for node in plan.graph.nodes if node.op == TwiceBlock.__name__]
    assert len(twice) == 3 and not any(node.checkpointable for node in twice), plan.capture
    assert_lowest_trains_as_the_model(plan, model, inputs)  # the other blocks checkpointed


def test_operators_under_no_grad_in_the_root_are_captured_by_export_with_the_switch() -> None:
    model, inputs = example(ScaledInTheRoot())
    assert planned_training_as_the_model(model, inputs).capture == "export"


def test_a_forward_that_takes_a_gradient_of_its_own_is_planned_and_trains() -> None:
    """Capture and profiling ran the model under `no_grad` to record its calls, where its
    `torch.autograd.grad` raised, and `optimize` failed; they run it with grad enabled now."""
    model, inputs = example(nn.Sequential(mlp_block(), mlp_block(), mlp_block(), GradientPenalty()))
    assert_lowest_trains_as_the_model(planned_training_as_the_model(model, inputs), model, inputs)


def _gradients_with_auxiliary_losses(
    module: nn.Module, blocks: list[AuxiliaryLoss], x: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of the output's loss plus every block's stored auxiliary loss, read after the forward."""
    output = module(x)
    loss = output.pow(2).mean() + sum(block.aux_loss for block in blocks)
    loss.backward()
    return [block.linear.weight.grad for block in blocks]


def test_a_loss_a_forward_stores_on_its_module_is_stored_by_the_plan_too() -> None:
    """NOTE [stored on the module]: FX left a Proxy in `aux_loss` and `plan.module` never set it."""
    model, (x,) = example(nn.Sequential(AuxiliaryLoss(), mlp_block(), AuxiliaryLoss(), mlp_block()))
    reference = copy.deepcopy(model)
    expected = _gradients_with_auxiliary_losses(reference, [reference[0], reference[2]], x)
    plan = planner.optimize(model, (x,), budget_gb=1)
    lowest = plan.replan(budget_bytes=plan.min_peak_bytes)
    assert lowest.module is not None and lowest.schedule.checkpointed, lowest.summary()
    assert all(isinstance(block.aux_loss, torch.Tensor) for block in (model[0], model[2])), "no Proxy left"
    for block in (model[0], model[2]):
        block.zero_grad()
    actual = _gradients_with_auxiliary_losses(lowest.module, [model[0], model[2]], x)
    for want, got in zip(expected, actual, strict=True):
        torch.testing.assert_close(got, want)


def test_an_autocast_a_forward_enters_keeps_its_dtype_under_the_steps_autocast() -> None:
    """NOTE [grad mode while tracing]: FX recorded the head's operators without its autocast, so under
    the step's bfloat16 autocast the planned head returned bfloat16 where the model's returns float32."""
    model, inputs = example(nn.Sequential(mlp_block(), mlp_block(), Float32Head()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = planner.optimize(model, inputs, budget_gb=1)
    assert plan.capture == "fx (exported: 2)", "export records the autocast FX refused"
    for module in (plan.module, plan.replan(budget_bytes=plan.min_peak_bytes).module):
        step = one_step(module, inputs, forward_context=torch.autocast("cpu", dtype=torch.bfloat16))
        expected = one_step(model, inputs, forward_context=torch.autocast("cpu", dtype=torch.bfloat16))
        assert_same_step(expected, step)


class SkippedByPythonDraw(nn.Module):
    """A layer that skips itself when Python's generator says so (LayerDrop as older code wrote it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and random.random() < 0.5:
            return x
        return torch.relu(self.linear(x))


class LayerDropByABoundDraw(nn.Module):
    """Three layers its own forward skips with a draw bound before any trace (`from random import
    random`), which only the generator's state shows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mlp_block() for _ in range(3))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and bound_draw() < 0.5:
                continue
            x = layer(x)
        return self.head(x)


def _step_with_python_seed(model: nn.Module | Variant, inputs: tuple[torch.Tensor], seed: int) -> Any:
    random.seed(seed)
    return one_step(model, inputs, seed=seed)


def test_a_layer_that_python_draws_skip_is_drawn_each_step() -> None:
    """NOTE [Python draws]: the layer is kept whole and run as written, so `plan.module` skips it when the
    model does, under every seed; it is never split at its children, whatever the profile drew (before,
    two of eight Python seeds split it), and the summary says its figures are the profile's draw's; and
    a root that skips its layers so is refused, saying how to stop it."""
    model, inputs = example(nn.Sequential(mlp_block(), SkippedByPythonDraw(), mlp_block()))
    for seed in range(8):
        random.seed(seed)
        plan = planner.optimize(model, inputs, budget_gb=1)
        assert plan.capture == "fx (opaque: 1)", (seed, plan.capture)
        assert random.getstate() == random.Random(seed).getstate(), "optimize drew from the user's stream"
    assert "drew from Python's or NumPy's random generator when profiled: 1;" in plan.summary()
    steps = [_step_with_python_seed(plan.module, inputs, seed) for seed in range(6)]
    for seed, step in enumerate(steps):
        assert_same_step(_step_with_python_seed(model, inputs, seed), step)
    assert len({step.loss.item() for step in steps}) > 1, "the layer ran, or was skipped, under every seed"
    with pytest.raises(planner.UnsupportedModel, match="layerdrop = 0.0"):
        planner.optimize(LayerDropByABoundDraw(), inputs, budget_gb=1)


class ScaledByPythonDraw(nn.Module):
    """An MLP whose hidden features are scaled by `random.uniform` (a jitter older code draws so)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x) * random.uniform(0.5, 1.5)))


class SkippedWideByPythonDraw(ScaledByPythonDraw):
    """The MLP, skipped when `random.random()` says so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and random.random() < 0.5:
            return x
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize(
    ("layer", "captured"),
    [(ScaledByPythonDraw, "fx (planned by children: 1)"), (SkippedWideByPythonDraw, "fx (opaque: 1)")],
)
def test_a_layer_drawing_from_python_replays_its_draw_when_checkpointed(
    layer: type[nn.Module], captured: str
) -> None:
    """NOTE [Python draws replayed] in planner/rewrite/emit.py: checkpoint restores torch's generators for
    a replay, not Python's; the layer checkpointed whole drew again in its replay, so its scale differed
    between forward and replay (other gradients), or it ran in one and was skipped in the other
    (CheckpointError: 5 tensors saved, 0 recomputed). Its checkpoint sets Python's generator back for
    the replay and leaves it where the step left it, as the model's own step does; under torch.compile
    too, where the checkpoint runs eagerly (compiled, its replay drew again). A layer whose draw picks no
    child is still split at its children; one that skips them by the draw is not."""
    model, inputs = example(nn.Sequential(mlp_block(), layer(), mlp_block()))
    plan = planner.optimize(model, inputs, budget_gb=1)
    assert plan.profile is not None and plan.capture == captured, plan.capture
    nodes = plan.graph.nodes
    assert {node.module_path for node in nodes if node.draws_python} == {"1"}, nodes
    (drawn,) = {node.part_of or node.name for node in nodes if node.draws_python}
    call = [index for index, node in enumerate(nodes) if (node.part_of or node.name) == drawn]
    start, stop = call[0], call[-1] + 1
    around_the_layer = Schedule(
        regions=(
            Region(0, start, RegionPolicy.STORE),
            Region(start, stop, RegionPolicy.CHECKPOINT),
            Region(stop, len(nodes), RegionPolicy.STORE),
        ),
        solver="test",
    )
    checkpointed = plan.profile.rewrite(around_the_layer)
    compiled = copy.deepcopy(checkpointed)
    compiled_variant = Variant(torch.compile(compiled), dict(compiled.named_parameters()), {})
    for seed in range(6):
        expected = _step_with_python_seed(model, inputs, seed)
        after_the_model = random.getstate()
        assert_same_step(expected, _step_with_python_seed(checkpointed, inputs, seed))
        assert random.getstate() == after_the_model
        assert_same_step(expected, _step_with_python_seed(compiled_variant, inputs, seed), rtol=COMPILED_RTOL)
        assert random.getstate() == after_the_model, "compiled, the replay drew again"


FIRST_EXPORT_OF_A_PROCESS = """
import sys, torch
from torch import nn
from planner.capture.chain import capture
assert "numpy.random" not in sys.modules, "NumPy's generator loaded before the export: nothing to check"
class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
    def forward(self, x, **options):
        return self.linear(x).square().mean()
print(capture(Root(), (torch.randn(4, 8),), {}).path)
"""


def test_the_first_export_of_a_process_is_no_python_draw() -> None:
    """NOTE [Python draws]: the first export of a process imports `numpy.random`, a generator that was not
    there when the trace began; counted as changed, it refused every model a fresh process exported."""
    run = subprocess.run(
        [sys.executable, "-c", FIRST_EXPORT_OF_A_PROCESS], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "export"


def test_a_forward_drawing_from_numpy_is_still_planned_by_its_submodules() -> None:
    """wav2vec2's SpecAugment draws its time masks from NumPy's generator in the model's own forward
    (Hugging Face's default `mask_time_prob` is 0.05). The draw picks no submodule, so the module level
    still splits the model at its layers (refusing every call that draws left it no unit), and the
    summary says that its figures are those of the profiled draw."""
    hf = transformers_module()
    torch.manual_seed(0)
    config = hf.Wav2Vec2Config(
        vocab_size=32, num_hidden_layers=2, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_size=32, num_attention_heads=2,
        intermediate_size=64, mask_time_prob=0.3, mask_time_length=2, layerdrop=0.0,
    )  # fmt: skip
    model = hf.Wav2Vec2ForCTC(config)
    model.freeze_feature_encoder()
    audio, labels = torch.randn(2, 1600), torch.randint(1, 32, (2, 8))
    plan = planner.optimize(model, example_kwargs={"input_values": audio, "labels": labels}, budget_gb=1)
    assert plan.capture == "module", plan.capture
    units = {node.module_path for node in plan.graph.nodes if node.part_of and node.op != GLUE_OP}
    assert "wav2vec2.encoder.layers.0.attention" in units, units
    assert "drew from Python's or NumPy's random generator when profiled: the model's own forward" in (
        plan.summary()
    )
