"""Plans of the compiled step (`optimize(..., compile=True)`), measured under inductor on the CPU.

Three models of different shapes, small enough to compile in seconds: a two-block GPT with dropout
(inductor draws its masks from seeds: recomputed dropout must replay them), seed 003's stack of
linear layers (whose input needs a gradient), and the zoo's U-Net (skip connections concatenated
into the decoder, BatchNorm, convolutions inductor runs in channels-last). At budgets min + f x
(baseline - min), f in {0.1, 0.5}: the compiled step's measured peak fits the budget, the prediction
is within 5 % of it, and loss and gradients equal those of `torch.compile` without checkpointing
under the same seed (dropout active).

Compiling is slow on a small CPU (each `optimize` here compiles once, `torch.compile` once per
model), so the models are tiny and everything else is planned without compiling
(`plan_compiled_step`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import planner
from planner import zoo
from planner.compiled import plan_compiled_step
from planner.compiled_split import compiled_pieces
from planner.compiled_step import ExampleStep, lowered_budget_bytes, raise_if_over
from planner.ir import TrainingStep
from planner.measurement import AllocatorPhases, LiveStorageTracker, default_loss, storage_bytes
from planner.testing.zoo_real import build_call

FRACTIONS = (0.1, 0.5)
PREDICTION_TOLERANCE = 0.05
GRADIENT_RTOL = 1e-4
"""Inductor fuses differently around a recomputed region: sums in another order, float32 rounding."""
SEED = 1234
HUGE_BUDGET_BYTES = 2**40


def _tiny_gpt() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    config = zoo.GPTConfig(
        vocabulary_size=128, sequence_length=32, model_width=64, head_count=2, layer_count=2
    )
    return zoo.TinyGPT(config), (torch.randint(config.vocabulary_size, (4, config.sequence_length)),)


def _unet() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    call = build_call("unet")
    return call.model, call.args


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]] = {
    "tiny_gpt": _tiny_gpt,
    "seed003_feedforward": lambda: zoo.build_model("seed003_feedforward"),
    "unet": _unet,
}


@dataclass(frozen=True)
class Reference:
    """A model's predicted range (planned without compiling) and `torch.compile`'s own training step."""

    min_peak_bytes: int
    baseline_peak_bytes: int
    loss: torch.Tensor
    gradients: torch.Tensor


def _gradients(module: torch.nn.Module, parameters: Any, inputs: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """Loss and every gradient (flattened, parameters then inputs) of one step under `SEED`."""
    torch.manual_seed(SEED)
    loss = default_loss(module(*inputs))
    targets = [*parameters, *(t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad)]
    gradients = torch.autograd.grad(loss, targets)
    return loss.detach(), torch.cat([g.flatten() for g in gradients])


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request: pytest.FixtureRequest) -> tuple[str, Reference]:
    name = request.param
    model, inputs = MODELS[name]()
    planned = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="auto", device=None,
    )  # fmt: skip
    compiled = torch.compile(model)
    loss, gradients = _gradients(compiled, list(model.parameters()), inputs)
    return name, Reference(planned.min_peak_bytes, planned.baseline_peak_bytes, loss, gradients)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_compiled_plan_fits_predicts_and_trains_as_torch_compile(
    reference: tuple[str, Reference], fraction: float
) -> None:
    name, expected = reference
    model, inputs = MODELS[name]()
    lowest, baseline = expected.min_peak_bytes, expected.baseline_peak_bytes
    budget = int(lowest + fraction * (baseline - lowest))
    plan = planner.optimize(model, inputs, budget_bytes=budget, compile=True)
    assert plan.module is not None and plan.compiled is not None
    assert plan.schedule.checkpointed, f"{name}: the plan must recompute something for the test to mean it"

    loss, gradients = _gradients(plan.module, list(model.parameters()), inputs)
    torch.testing.assert_close(loss, expected.loss, rtol=GRADIENT_RTOL, atol=0.0)
    error = ((gradients - expected.gradients).norm() / expected.gradients.norm()).item()
    assert error <= GRADIENT_RTOL, f"{name}: gradients differ by {error:.1e} of their norm\n{plan.summary()}"

    measured = planner.measure(plan.module, inputs).peak_bytes
    assert measured <= budget, f"{name}: measured {measured} over budget {budget}\n{plan.summary()}"
    prediction_error = abs(plan.predicted_peak_bytes - measured) / measured
    assert prediction_error <= PREDICTION_TOLERANCE, (
        f"{name}: predicted {plan.predicted_peak_bytes}, measured {measured} ({prediction_error:.1%})\n"
        f"{plan.summary()}"
    )
    assert plan.compiled.measured_peak_bytes is not None and plan.compiled.measured_peak_bytes <= budget


class _Logits(torch.nn.Module):
    """A language model that returns its logits (the loss runs after it)."""

    def __init__(self, vocabulary_size: int, width: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocabulary_size, width)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocabulary_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embedding(token_ids))))


class _LogitsAndLoss(_Logits):
    """A language model that returns its logits beside the loss it computes, as Hugging Face's do."""

    def forward(  # type: ignore[override]
        self, token_ids: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(token_ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss, logits


def test_saved_logits_that_the_forward_also_returns_are_held_through_the_backward() -> None:
    """NOTE [saved outputs] in compiled_graph.py: the logits are saved for the loss's backward and
    returned, so the backward can neither free nor reuse them, nor reuse the zero gradient autograd
    makes for the unused logits. The model let it reuse both and predicted a logits buffer (26 %) low."""
    torch.manual_seed(0)
    vocabulary_size, tokens = 2048, (4, 64)
    model = _LogitsAndLoss(vocabulary_size, width=32)
    token_ids, labels = (torch.randint(vocabulary_size, tokens) for _ in range(2))
    plan = planner.optimize(
        model, (token_ids, labels), budget_bytes=HUGE_BUDGET_BYTES, compile=True, loss_fn=lambda out: out[0]
    )
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes is not None
    measured = plan.compiled.measured_peak_bytes
    logits_bytes = tokens[0] * tokens[1] * vocabulary_size * 4
    assert "backward" in plan.summary().split("peak set in:")[1].splitlines()[0], plan.summary()
    assert abs(plan.predicted_peak_bytes - measured) <= PREDICTION_TOLERANCE * measured < logits_bytes, (
        f"predicted {plan.predicted_peak_bytes}, measured {measured}\n{plan.summary()}"
    )


class _TiedLoss(torch.nn.Module):
    """A language model whose head shares the input embedding's weight (as GPT-2's does), loss inside."""

    def __init__(self, vocabulary_size: int, width: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocabulary_size, width)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU())
        self.down = torch.nn.Linear(4 * width, width)
        self.head = torch.nn.Linear(width, vocabulary_size, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, token_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.down(self.hidden(self.embedding(token_ids))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_a_tied_head_holds_the_logits_gradient_until_its_weight_gradient_is_summed() -> None:
    """NOTE [addmm] in compiled_fusion.py: inductor folds the head's weight gradient into the add that
    sums it with the embedding's, at the end of the backward, so the logits' gradient lives until
    then. The lowest plan was predicted 2 MiB (that gradient) below what it measured, could not be
    planned at its own lowest peak, and GPT-2's plans measured over their budgets."""
    torch.manual_seed(0)
    vocabulary_size, tokens = 3072, (8, 64)
    model = _TiedLoss(vocabulary_size, width=128)
    inputs = tuple(torch.randint(vocabulary_size, tokens) for _ in range(2))
    lowest = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="dp", device=None,
    ).min_peak_bytes  # fmt: skip
    plan = planner.optimize(model, inputs, budget_bytes=lowest, compile=True, solver="dp")
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes is not None
    measured = plan.compiled.measured_peak_bytes
    assert plan.compiled.attempts == 1 and measured <= lowest, plan.summary()
    assert plan.predicted_peak_bytes - measured <= 0.001 * measured, plan.summary()


def test_a_budget_below_the_compiled_minimum_raises_before_anything_compiles() -> None:
    model, inputs = zoo.build_model("seed003_feedforward")
    lowest = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="dp", device=None,
    ).min_peak_bytes  # fmt: skip
    with pytest.raises(planner.InfeasibleBudget) as raised:
        planner.optimize(model, inputs, budget_bytes=lowest - 1, compile=True)
    assert raised.value.min_peak_bytes == lowest


def test_a_plan_measured_over_its_budget_is_planned_again_below_the_models_miss() -> None:
    """NOTE [checked budget]: BERT's second compilation (measured in bench/compare.py) was predicted
    at 4,351,832 bytes under a planned 4,385,112 and measured 4,744,284, 5,548 over its 4,738,736
    budget. Lowering the planned budget by the excess alone (to 4,379,564) admits the same schedule
    again; lowering the budget by the model's miss does not."""
    budget, planned, predicted, measured = 4_738_736, 4_385_112, 4_351_832, 4_744_284
    lowered = lowered_budget_bytes(
        budget_bytes=budget, predicted_bytes=predicted, measured_bytes=measured, min_peak_bytes=0
    )
    assert lowered == 4_346_284
    assert lowered < predicted < planned - (measured - budget)
    lowest = lowered_budget_bytes(
        budget_bytes=1000, predicted_bytes=500, measured_bytes=1500, min_peak_bytes=400
    )
    assert lowest == 400, "never below the lowest peak any plan reaches"


class _CheckedRoot(torch.nn.Module):
    """Checked convolution blocks under a root that branches on its output's sum: neither fx nor
    torch.export traces the root, so the plan is made by submodules (whole blocks as units)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_CheckedConvBlock(16, checked=True) for _ in range(4))
        self.head = torch.nn.Linear(16 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if x.sum() > 1e9:
            x = torch.zeros_like(x)
        return self.head(x.flatten(1))


def test_a_checkpointed_unit_that_breaks_the_graph_updates_batchnorm_statistics_once() -> None:
    """NOTE [checkpointed breaks] for a plan made by submodules: each checkpointed block is a unit, and
    compiled by hand, the three units dynamo broke in updated their BatchNorm statistics twice."""
    torch.manual_seed(SEED)
    model, inputs = _CheckedRoot(), (torch.randn(8, 16, 16, 16),)
    reference = copy.deepcopy(model)
    expected = _statistics_after_one_step(torch.compile(reference), reference, inputs)
    planned = copy.deepcopy(model)
    eager = planner.optimize(planned, inputs, budget_bytes=HUGE_BUDGET_BYTES)
    plan = planner.optimize(planned, inputs, budget_bytes=eager.min_peak_bytes)
    assert plan.capture.startswith("module") and plan.regions, plan.summary()
    _assert_updated_once(_statistics_after_one_step(torch.compile(plan.module), planned, inputs), expected)


def test_a_split_step_budget_refused_after_three_compilations_is_one_the_hand_method_misses_too() -> None:
    """NOTE [checked budget] on a split step not in the zoo: at 0.2 of its eager range every compilation
    measured over the budget (in a fresh process), and `optimize` says no plan fits, naming the lowest
    peak it measured; `checkpoint_wrapper` on every block, compiled, measures above the budget and
    that peak. Where a plan is returned instead, it measures within the budget."""
    model, inputs = _checked_conv_net()
    eager = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="dp", device=None,
    )  # fmt: skip
    budget = round(eager.min_peak_bytes + 0.2 * (eager.baseline_peak_bytes - eager.min_peak_bytes))
    by_hand = copy.deepcopy(model)
    for index, block in enumerate(by_hand[0]):
        by_hand[0][index] = checkpoint_wrapper(block)
    hand_bytes = planner.measure(torch.compile(by_hand), inputs).peak_bytes
    try:
        plan = planner.optimize(model, inputs, budget_bytes=budget, solver="dp", compile=True)
    except planner.InfeasibleBudget as raised:  # what a fresh process does (the measurements move with
        # what the process compiled before: in the whole suite a plan may fit)
        assert budget < raised.min_peak_bytes <= hand_bytes, (budget, raised.min_peak_bytes, hand_bytes)
    else:
        assert plan.compiled is not None and plan.compiled.measured_peak_bytes is not None
        assert plan.compiled.measured_peak_bytes <= budget < hand_bytes, plan.summary()


def test_a_plan_still_measured_over_its_budget_after_the_last_compilation_is_refused() -> None:
    """NOTE [checked budget]: a split step of four convolution blocks with BatchNorm (the second checking
    for NaN, not a zoo model) measured over its budget at every one of its three compilations (2.15 MB
    against 1.98 at the last) and `optimize` returned that plan, its summary saying OVER. It raises
    now, naming the lowest peak a compilation measured."""
    model, inputs = _checked_conv_net()
    plan = planner.profile(model, inputs).plan(budget_bytes=HUGE_BUDGET_BYTES)
    with pytest.raises(planner.InfeasibleBudget) as raised:
        raise_if_over(plan, 1000, [1300, 1200, 1250])
    assert raised.value.min_peak_bytes == 1200 and raised.value.budget_bytes == 1000
    raise_if_over(plan, 1000, [1300, 1000])  # the last compilation measured within the budget


def test_a_log_call_in_the_forward_does_not_split_the_planned_step() -> None:
    """NOTE [graph breaks]: Hugging Face's GPT-2 logs a warning from its loss; dynamo would split the
    step there, and planning would refuse it."""
    call = build_call("hf_gpt2")
    plan = plan_compiled_step(
        call.model, call.args, call.kwargs, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam",
        step=TrainingStep(), loss_fn=default_loss, solver="dp", device=None,
    )  # fmt: skip
    assert plan.min_peak_bytes < plan.baseline_peak_bytes


def test_with_budget_to_spare_no_solver_plans_above_no_checkpointing() -> None:
    """A language model whose loss runs eagerly after it: checkpointing the whole model while keeping
    its matmuls costs no recompute (the head is the region's last node), so it tied with saving
    everything on recompute, and `ilp` kept it at a 128 KiB higher peak; a tie now goes to the lower peak."""
    torch.manual_seed(0)
    vocabulary_size, tokens = 3072, (8, 64)
    model = _Logits(vocabulary_size, width=64)
    token_ids, labels = (torch.randint(vocabulary_size, tokens) for _ in range(2))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    for solver in ("dp", "ilp"):
        plan = plan_compiled_step(
            model, (token_ids,), {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam",
            step=TrainingStep(), loss_fn=loss_fn, solver=solver, device=None,
        )  # fmt: skip
        assert plan.predicted_peak_bytes <= plan.baseline_peak_bytes, f"{solver}\n{plan.summary()}"


def test_compile_plans_one_process() -> None:
    model, inputs = zoo.build_model("seed000_mlp")
    with pytest.raises(ValueError, match="world_size=2"):
        planner.optimize(model, inputs, budget_gb=1, compile=True, world_size=2)


def test_the_allocator_counts_an_eager_step_as_the_storage_tracker_does() -> None:
    """The measurement compiled steps use (NOTE [compiled steps] in measurement.py) against the one
    eager plans are held to, on a step both can see."""
    model, inputs = zoo.build_model("seed000_mlp")
    resident = [*model.parameters(), *inputs]
    copied = copy.deepcopy(model)

    def step(module: torch.nn.Module, on_phase: Callable[[str], None]) -> None:
        loss = default_loss(module(*inputs))
        on_phase("forward")
        loss.backward()
        on_phase("backward")

    tracker = LiveStorageTracker()
    tracker.track(resident)
    with tracker:
        step(model, lambda phase: None)
    with AllocatorPhases(storage_bytes([*copied.parameters(), *inputs])) as allocator:
        step(copied, allocator.on_phase)
    assert max(allocator.peaks.values()) == tracker.peak_bytes


def test_a_compiled_plan_explains_itself_against_the_eager_plan() -> None:
    model, inputs = zoo.build_model("seed003_feedforward")
    eager = planner.optimize(model, inputs, budget_bytes=HUGE_BUDGET_BYTES, solver="dp")
    budget = (eager.min_peak_bytes + eager.baseline_peak_bytes) // 2
    eager = eager.replan(budget_bytes=budget, solver="dp")
    compiled = plan_compiled_step(
        model, inputs, {}, budget_bytes=budget, optimizer="adam", step=TrainingStep(), loss_fn=default_loss,
        solver="dp", device=None,
    )  # fmt: skip
    text = compiled.compare(eager)
    assert "compiled plan vs eager plan" in text
    assert planner.errors.format_bytes(compiled.baseline_peak_bytes) in text
    assert planner.errors.format_bytes(eager.baseline_peak_bytes) in text
    assert compiled.capture.startswith("torch.compile")
    assert "analytic" in compiled.graph.timing


def test_no_compiled_peer_measures_below_the_lowest_peak_we_plan() -> None:
    """Where we call a budget infeasible, the hand methods cannot fit it either: `torch.compile`'s own
    recompute (`activation_memory_budget` 0.5, 0.2, 0.0) and `checkpoint_wrapper` on every block,
    compiled, each measure at or above our lowest compiled peak; our plan there measures exactly what
    it predicts. Seed 003 at 0.2 measured 78.16 MiB while our lowest was predicted at 83.15 MiB: a
    replay's storages were held through the trigger's whole backward, though a compiled backward frees
    each after its last reader (NOTE [early release] in simulate.py), and the loss and its seed
    gradient (8 bytes) were not counted."""
    from bench.compare import budget_backend
    from bench.peers import every_block_peer

    model, inputs = zoo.build_model("seed003_feedforward")
    lowest = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="dp", device=None,
    ).min_peak_bytes  # fmt: skip
    peers = {
        f"activation_memory_budget={fraction}": torch.compile(
            copy.deepcopy(model), backend=budget_backend(fraction)
        )
        for fraction in (0.5, 0.2, 0.0)
    }
    peers["checkpoint_wrapper on every block"] = torch.compile(every_block_peer(model)[0].module)
    with torch._dynamo.config.patch(recompile_limit=64):
        for name, peer in peers.items():
            measured = planner.measure(peer, inputs).peak_bytes
            assert measured >= lowest, f"{name} measured {measured}, below our lowest {lowest}"
        plan = planner.optimize(model, inputs, budget_bytes=lowest, compile=True)
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes == plan.predicted_peak_bytes


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_step_dynamo_splits_is_planned_eagerly_compiled_and_measured(fraction: float) -> None:
    """NOTE [graph breaks]: untraceable_mlp branches on a tensor's value; dynamo runs the Sequential
    eagerly and compiles only the gated Linear, so no joint graph describes the step. The eager plan
    is compiled as it is, with its compiled pieces saving what eager autograd saves, so the compiled
    peak is the eager prediction within a few bytes (inductor's own partition saved a 128 KiB ReLU
    mask beside the output the next Linear keeps: plans measured up to 252 KiB over and were made
    again); the plan fits the budget and trains as the compiled model does. At the eager step's peak
    nothing is checkpointed and the model itself is compiled (its planned module measured 1 KiB over
    and a region was checkpointed for it)."""
    model, inputs = zoo.build_model("untraceable_mlp")
    eager = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="dp", device=None,
    )  # fmt: skip
    assert eager.capture.startswith("fx") and eager.module is None, "the eager plan optimize starts from"
    budget = round(eager.min_peak_bytes + fraction * (eager.baseline_peak_bytes - eager.min_peak_bytes))
    plan = planner.optimize(model, inputs, budget_bytes=budget, compile=True)
    assert plan.compiled is not None and "Data-dependent branching" in plan.compiled.graph_breaks
    assert "breaks this step's graph" in plan.summary()
    measured = planner.measure(plan.module, inputs).peak_bytes
    assert measured == plan.compiled.measured_peak_bytes and measured <= budget, plan.summary()
    assert abs(measured - plan.predicted_peak_bytes) <= 4096, plan.summary()
    if fraction == 1.0:  # the eager peak fits: the model itself compiled once, measured as predicted
        assert not plan.regions and plan.compiled.attempts == 1, plan.summary()
        assert measured == plan.predicted_peak_bytes, plan.summary()
    model.zero_grad(set_to_none=True)
    expected_loss, expected = _gradients(torch.compile(model), list(model.parameters()), inputs)
    loss, gradients = _gradients(plan.module, list(model.parameters()), inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=GRADIENT_RTOL, atol=0.0)
    assert ((gradients - expected).norm() / expected.norm()).item() <= GRADIENT_RTOL


class _ResidualBlock(torch.nn.Module):
    """LayerNorm, MLP and dropout around a residual; `checked` blocks also replace a NaN output by
    zeros (a data-dependent branch: fx cannot trace it, dynamo breaks its graph there) and drop out
    in their own code, not through a Dropout module."""

    def __init__(self, width: int, *, checked: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.1)
        self.checked = checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.down(self.act(self.up(self.norm(x))))
        if not self.checked:
            return x + self.drop(hidden)
        hidden = torch.nn.functional.dropout(hidden, 0.1, self.training)
        if torch.isnan(hidden).any():
            hidden = torch.zeros_like(hidden)
        return x + hidden


def _checked_residual_mlp() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    torch.manual_seed(SEED)
    blocks = [_ResidualBlock(64, checked=index == 2) for index in range(5)]
    model = torch.nn.Sequential(torch.nn.Sequential(*blocks), torch.nn.Linear(64, 64))
    return model, (torch.randn(16, 32, 64),)


def test_a_checkpoint_around_a_graph_break_is_planned_only_where_nothing_else_fits() -> None:
    """NOTE [eager draws] in compiled_split.py, on a model not built for it: a checkpoint of the block
    dynamo breaks in runs eagerly, and its eager dropout drew other masks than compiled no
    checkpointing (loss 5819.75 against 5857.53 at 0.1 of the range). Its whole call is planned only
    below the lowest peak without it; above that the plan trains exactly as compiled no checkpointing."""
    model, inputs = _checked_residual_mlp()
    expected_loss, expected = _gradients(torch.compile(model), list(model.parameters()), inputs)
    model.zero_grad(set_to_none=True)
    refused = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="dp", device=None,
    )  # fmt: skip
    lowest_bytes = planner.profile(model, inputs).plan(budget_bytes=HUGE_BUDGET_BYTES).min_peak_bytes
    assert lowest_bytes < refused.min_peak_bytes, "checkpointing the block whole reaches lower"

    budget = round(refused.min_peak_bytes + 0.1 * (refused.baseline_peak_bytes - refused.min_peak_bytes))
    plan = planner.optimize(model, inputs, budget_bytes=budget, solver="dp", compile=True)
    assert plan.compiled is not None and plan.schedule.checkpointed, plan.summary()
    assert plan.compiled.eager_draw_calls == ("0.2",) and not plan.compiled.checkpointed_draw_calls
    assert "not checkpointed whole: 0.2 (they draw random numbers" in plan.summary()
    assert plan.compiled.measured_peak_bytes is not None and plan.compiled.measured_peak_bytes <= budget
    loss, gradients = _gradients(plan.module, list(model.parameters()), inputs)
    model.zero_grad(set_to_none=True)
    assert torch.equal(loss, expected_loss) and torch.equal(gradients, expected)

    below = (lowest_bytes + refused.min_peak_bytes) // 2
    plan = planner.optimize(model, inputs, budget_bytes=below, solver="dp", compile=True)
    assert plan.compiled is not None and plan.compiled.checkpointed_draw_calls == ("0.2",)
    assert "checkpointed whole although they draw random numbers: 0.2" in plan.summary()
    assert plan.compiled.measured_peak_bytes is not None and plan.compiled.measured_peak_bytes <= below
    loss, _ = _gradients(plan.module, list(model.parameters()), inputs)
    model.zero_grad(set_to_none=True)
    assert not torch.equal(loss, expected_loss), "the eager checkpoint draws its own dropout masks"


class _CheckedConvBlock(torch.nn.Module):
    """Convolution, BatchNorm and ReLU around a residual; a `checked` block replaces a NaN output by
    zeros (a data-dependent branch: fx cannot trace it, dynamo breaks its graph there)."""

    def __init__(self, channels: int, *, checked: bool) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(channels)
        self.checked = checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm(self.conv(x)))
        if self.checked and torch.isnan(y).any():
            y = torch.zeros_like(y)
        return x + y


def _checked_conv_net() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    torch.manual_seed(SEED)
    blocks = [_CheckedConvBlock(16, checked=index == 1) for index in range(4)]
    model = torch.nn.Sequential(
        torch.nn.Sequential(*blocks), torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 10)
    )
    return model, (torch.randn(8, 16, 16, 16),)


def _statistics_after_one_step(
    module: torch.nn.Module, model: torch.nn.Module, inputs: tuple[Any, ...]
) -> dict[str, torch.Tensor]:
    """`model`'s BatchNorm buffers after one training step through `module` (which shares them)."""
    default_loss(module(*inputs)).backward()
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def _assert_updated_once(statistics: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, value in expected.items():
        if name.endswith("num_batches_tracked"):
            assert statistics[name].item() == value.item() == 1, name
        else:
            torch.testing.assert_close(statistics[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_checkpoint_around_a_graph_break_updates_batchnorm_statistics_once() -> None:
    """NOTE [checkpointed breaks] in rewrite.py, on a model not built for it: dynamo gives up on a
    checkpoint whose code breaks its graph and runs it eagerly from the compiling branch, where the
    replay did not restore the buffers: the region holding the checked block and the one before it
    updated both BatchNorms' statistics twice (num_batches_tracked 2). Such a region now runs outside
    dynamo with its replay's contexts, in an eager plan compiled by hand and as compile=True compiles a
    split step's plan (a budget is not asked for: the compiled measurements of this model's plans move
    with what the process compiled before, and a budget check could refuse the plan)."""
    model, inputs = _checked_conv_net()
    reference = copy.deepcopy(model)
    expected = _statistics_after_one_step(torch.compile(reference), reference, inputs)

    by_hand = copy.deepcopy(model)
    eager = planner.optimize(by_hand, inputs, budget_bytes=HUGE_BUDGET_BYTES)
    plan = planner.optimize(by_hand, inputs, budget_bytes=eager.min_peak_bytes)
    assert any("0.1" in region.modules for region in plan.regions), plan.summary()
    _assert_updated_once(_statistics_after_one_step(torch.compile(plan.module), by_hand, inputs), expected)

    planned = copy.deepcopy(model)
    plan = planner.optimize(planned, inputs, budget_bytes=eager.min_peak_bytes)
    assert plan.module is not None
    call = ExampleStep(planned, inputs, {}, default_loss, list(planned.parameters()))
    compiled = compiled_pieces(plan.module, call)  # as optimize(..., compile=True) compiles a split step
    _assert_updated_once(_statistics_after_one_step(compiled, planned, inputs), expected)


def test_recomputes_of_two_regions_are_not_fused_into_one_step() -> None:
    """NOTE [horizontal fusion] in compiled.py: GPT-2's two attention recomputes read the same mask and
    seeds, inductor fused them horizontally, and the later layer's recompute ran with the earlier one's:
    a plan predicted at 3.28 MiB measured 3.79 MiB (15 % over)."""
    call = build_call("hf_gpt2")
    reference = plan_compiled_step(
        call.model, call.args, call.kwargs, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam",
        step=TrainingStep(), loss_fn=default_loss, solver="dp", device=None,
    )  # fmt: skip
    lowest, baseline = reference.min_peak_bytes, reference.baseline_peak_bytes
    budget = int(lowest + 0.1 * (baseline - lowest))
    plan = planner.optimize(
        call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget, solver="dp", compile=True
    )
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes is not None
    measured = plan.compiled.measured_peak_bytes
    assert measured <= budget, plan.summary()
    assert abs(plan.predicted_peak_bytes - measured) <= PREDICTION_TOLERANCE * measured, plan.summary()


def test_a_replay_after_a_steps_last_kernel_runs_after_that_step_frees() -> None:
    """NOTE [kernel groups]: Llama's final norm, replayed for the head's weight gradient, followed the
    log-softmax backward's kernel with no matrix multiply between, so inductor's C++ backend computed
    both in one function while the logits, their gradient and autograd's zero gradient were allocated:
    the `ilp` plan at 0.7 of the range measured 48 KiB above its prediction and over its budget.
    Flushed at the step's end, it runs after they are freed, and the prediction does not fall short
    of the measurement."""
    call = build_call("hf_llama")
    planned = plan_compiled_step(
        call.model, call.args, call.kwargs, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam",
        step=TrainingStep(), loss_fn=default_loss, solver="dp", device=None,
    )  # fmt: skip
    budget = int(planned.min_peak_bytes + 0.7 * (planned.baseline_peak_bytes - planned.min_peak_bytes))
    plan = planner.optimize(
        call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget, solver="ilp", compile=True
    )
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes is not None
    assert plan.schedule.checkpointed, plan.summary()
    assert plan.compiled.measured_peak_bytes <= plan.predicted_peak_bytes, plan.summary()
    assert plan.compiled.attempts == 1, plan.summary()


def test_a_planned_module_recompiles_for_another_shape_and_trains() -> None:
    """A call at another batch size recompiles (static shapes), and the new graph is planned on its own:
    a second graph after `optimize` has compiled is no graph break (it once raised one)."""
    model, inputs = _tiny_gpt()
    plan = planner.optimize(model, inputs, budget_bytes=HUGE_BUDGET_BYTES, compile=True)
    assert plan.module is not None
    half = (inputs[0][: inputs[0].shape[0] // 2],)
    default_loss(plan.module(*half)).backward()
    assert all(parameter.grad is not None for parameter in model.parameters())
