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

import planner
from planner import zoo
from planner.compiled.optimize import plan_compiled_step
from planner.compiled.step import lowered_budget_bytes
from planner.ir import ActivationGraph, Region, RegionPolicy, Schedule, TrainingStep
from planner.profiler.counting import AllocatorPhases, LiveStorageTracker
from planner.profiler.measurement import default_loss
from planner.solvers import SOLVERS
from planner.testing.zoo_real import build_call
from tests.planner.compiled_steps import GRADIENT_RTOL, HUGE_BUDGET_BYTES, compiled_gradients

FRACTIONS = (0.1, 0.5)
PREDICTION_TOLERANCE = 0.05


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


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request: pytest.FixtureRequest) -> tuple[str, Reference]:
    name = request.param
    model, inputs = MODELS[name]()
    planned = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="auto", device=None,
    )  # fmt: skip
    compiled = torch.compile(model)
    loss, gradients = compiled_gradients(compiled, list(model.parameters()), inputs)
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

    loss, gradients = compiled_gradients(plan.module, list(model.parameters()), inputs)
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


def test_a_compiled_plan_for_lightnings_order_fits() -> None:
    """NOTE [loop orders]: the last step's gradients alive through the compiled forward alone, as
    Lightning's automatic optimization runs it; the check after compiling counts them in that phase."""
    model, inputs = MODELS["tiny_gpt"]()
    step = TrainingStep(zero_grad_before_backward=True)
    reference = planner.optimize(model, inputs, budget_bytes=HUGE_BUDGET_BYTES, compile=True, step=step)
    assert reference.graph.static.forward_gradient_bytes > 0
    budget = (reference.min_peak_bytes + reference.baseline_peak_bytes) // 2
    plan = planner.optimize(model, inputs, budget_bytes=budget, compile=True, step=step)
    assert plan.module is not None and plan.schedule.checkpointed
    measured = planner.measure(plan.module, inputs, step=step).peak_bytes
    assert measured <= budget, f"measured {measured} over budget {budget}\n{plan.summary()}"
    assert abs(plan.predicted_peak_bytes - measured) <= PREDICTION_TOLERANCE * measured


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
    """NOTE [saved outputs] in compiled/backward_order.py: the logits are saved for the loss's backward and
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
    """NOTE [addmm] in compiled/fusion.py: inductor folds the head's weight gradient into the add that
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
    """The measurement compiled steps use (NOTE [compiled steps] in profiler/measurement.py) against the one
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
    with AllocatorPhases([*copied.parameters(), *inputs]) as allocator:
        step(copied, allocator.on_phase)
    assert max(allocator.peaks.values()) == tracker.peak_bytes
    assert max(allocator.exact_peaks.values()) == tracker.exact_peak_bytes


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
    each after its last reader (NOTE [early release] in simulation/step.py), and the loss and its seed
    gradient (8 bytes) were not counted."""
    from bench.compare_measurement import budget_backend
    from planner.testing.hand_methods import every_block

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
    by_hand = every_block(model).variant
    assert by_hand is not None
    peers["checkpoint_wrapper on every block"] = torch.compile(by_hand.module)
    with torch._dynamo.config.patch(recompile_limit=64):
        for name, peer in peers.items():
            measured = planner.measure(peer, inputs).peak_bytes
            assert measured >= lowest, f"{name} measured {measured}, below our lowest {lowest}"
        plan = planner.optimize(model, inputs, budget_bytes=lowest, compile=True)
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes == plan.predicted_peak_bytes


def test_recomputes_of_two_regions_are_not_fused_into_one_step() -> None:
    """NOTE [horizontal fusion] in compiled/optimize.py: GPT-2's two attention recomputes read the same
    mask and seeds, inductor fused them horizontally, and the later layer's recompute ran with the earlier
    one's: a plan predicted at 3.28 MiB measured 3.79 MiB (15 % over)."""
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


def test_the_unets_lowest_compiled_plan_fits_its_own_predicted_minimum() -> None:
    """NOTE [saved region outputs] in simulation/step.py: a checkpointed BatchNorm's backward reads the
    ReLU output after it, which the convolution after the region saves, and inductor reads that saved
    value instead of recomputing it. Released after the convolution's backward, the U-Net's lowest
    plan was predicted at 3.79 MiB and measured 4.00: `optimize` at the minimum it printed raised
    `InfeasibleBudget` after three compilations."""
    model, inputs = _unet()
    lowest = plan_compiled_step(
        model, inputs, {}, budget_bytes=HUGE_BUDGET_BYTES, optimizer="adam", step=TrainingStep(),
        loss_fn=default_loss, solver="auto", device=None,
    ).min_peak_bytes  # fmt: skip
    plan = planner.optimize(model, inputs, budget_bytes=lowest, compile=True)
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes is not None
    measured = plan.compiled.measured_peak_bytes
    assert plan.compiled.attempts == 1 and measured <= lowest, plan.summary()
    assert plan.predicted_peak_bytes - measured <= 0.02 * measured, plan.summary()


_C, _S = RegionPolicy.CHECKPOINT, RegionPolicy.STORE
UNET_PLANS: dict[str, tuple[Region, ...]] = {
    # At 0.1 of the U-Net's range, from the ILP cut short (as on a loaded machine): the peak is in the
    # backward of the transposed convolution whose output the decoder concatenates with a skip.
    "skip_concatenation": (
        Region(0, 2, _S), Region(2, 8, _C, (3, 6)), Region(8, 9, _S), Region(9, 16, _C, (10, 13)),
        Region(16, 31, _C, (17, 19, 20, 25, 28)), Region(31, 33, _S), Region(33, 36, _C, (33,)),
        Region(36, 40, _S),
    ),
    # At 0.7 of its range, the ILP's first plan: its last checkpointed block replays a ReLU output
    # for the convolution backward that follows the BatchNorm backward before it.
    "replay_after_batch_norm": (
        Region(0, 2, _S), Region(2, 6, _C, (2, 3)), Region(6, 16, _S),
        Region(16, 23, _C, (16, 17, 18, 19, 20)), Region(23, 25, _S), Region(25, 30, _C, (25, 27, 28)),
        Region(30, 33, _S), Region(33, 36, _C, (33,)), Region(36, 40, _S),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(UNET_PLANS))
def test_a_unet_plan_is_not_predicted_below_its_measurement(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`skip_concatenation`: NOTE [sliced arguments] in compiled/kernel_scratch.py (the transposed
    convolution's backward copies its gradient, a slice of the concatenation's, into a dense one; it
    was predicted 114 KiB, 2.7 %, low). `replay_after_batch_norm`: NOTE [realized inputs] in
    compiled/backward_order.py (the BatchNorm backward's tail ran after the replay, at the place of the
    convolution backward that realized it; 187 KiB, 3.3 %, low, and compiled twice). Each is now an
    upper bound: the simulator replays a region whole at its trigger, where inductor recomputes each
    value before its first reader (`skip_concatenation`: 3.4 % high, two replayed 64 KiB values)."""
    regions = UNET_PLANS[name]

    def fixed(graph: ActivationGraph, *, budget_bytes: int) -> Schedule:
        assert len(graph.nodes) == regions[-1].stop, "the U-Net's compiled graph changed"
        return Schedule(regions=regions, solver="auto")

    monkeypatch.setitem(SOLVERS, "auto", fixed)
    model, inputs = _unet()
    plan = planner.optimize(model, inputs, budget_bytes=HUGE_BUDGET_BYTES, compile=True)
    assert plan.compiled is not None and plan.compiled.measured_peak_bytes is not None
    measured = plan.compiled.measured_peak_bytes
    assert measured <= plan.predicted_peak_bytes <= (1 + PREDICTION_TOLERANCE) * measured, (
        f"predicted {plan.predicted_peak_bytes}, measured {measured}\n{plan.summary()}"
    )
