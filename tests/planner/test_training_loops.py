"""plan.module under the training loops people run, each planned for its own order (NOTE [loop orders]
in planner/ir.py): Lightning's Trainer with automatic and with manual optimization, Fabric, the Hugging
Face Trainer with gradient accumulation, accelerate's `accumulate` and a plain torchtitan-style loop.

Each trains plan.module for three optimizer steps, counts the peak of those steps with the live-storage
tracker in 512-byte blocks (parameters and buffers tracked from the start, everything else as it is
made: batches, gradients, optimizer state, activations) against the plan's budget, and compares the
parameters with the unplanned model's after the same steps. A two-layer GPT-2 from a config, on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

import planner
from planner.ir import MemoryCounting
from planner.profiler.counting import LiveStorageTracker

pytestmark = pytest.mark.skipif(
    any(
        importlib.util.find_spec(name) is None for name in ("transformers", "accelerate", "pytorch_lightning")
    ),
    reason="needs transformers, accelerate and pytorch-lightning (pip install -e '.[dev]')",
)

BATCH, SEQUENCE, STEPS = 4, 32, 3
LEARNING_RATE = 1e-3


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).train()


def _samples(count: int) -> list[dict[str, torch.Tensor]]:
    """A data set, on the host (see `_host_collate`)."""
    with _disable_current_modes():
        tokens = torch.randint(512, (count, SEQUENCE), generator=torch.Generator().manual_seed(1))
        return [{"input_ids": row, "labels": row} for row in tokens]


def _host_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch made where a GPU loop makes it, on the host: the tracker, standing in for the device's
    allocator, does not see it (Lightning also holds the next batch there, prefetched)."""
    with _disable_current_modes():
        batch: dict[str, torch.Tensor] = torch.utils.data.default_collate(samples)
    return batch


def _on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch copied to the device, as `batch.to("cuda")` does: what the budget counts as inputs."""
    return {name: tensor.clone() for name, tensor in batch.items()}


def _loader(micro_batch: int, count: int) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(
        _samples(micro_batch * count), batch_size=micro_batch, collate_fn=_host_collate
    )


def _batches(micro_batch: int, count: int) -> list[dict[str, torch.Tensor]]:
    return list(_loader(micro_batch, count))


def the_loss(output: Any) -> torch.Tensor:
    loss: torch.Tensor = output.loss
    return loss


@dataclass(frozen=True)
class Planned:
    model: torch.nn.Module
    plan: planner.Plan
    budget_bytes: int

    def copies(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the original model, plan.module), each with parameters of its own."""
        assert self.plan.module is not None
        return copy.deepcopy(self.model), copy.deepcopy(self.plan.module)


def plan_for(step: planner.TrainingStep, example: dict[str, Any]) -> Planned:
    """GPT-2 planned for `step` at the middle of its budget range."""
    model = _gpt2()
    profile = planner.profile(model, example_kwargs=example, step=step, loss_fn=the_loss)
    frontier = profile.pareto(points=2, solver="dp")
    budget = (frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2
    plan = profile.plan(budget_bytes=budget, solver="dp")
    assert plan.regions, "the middle budget must need checkpointing, or the test proves nothing"
    return Planned(model=model, plan=plan, budget_bytes=budget)


def peak_while(module: torch.nn.Module, run: Callable[[], None]) -> int:
    """The peak of live tensor storages, in 512-byte blocks, while `run()` trains `module`."""
    tracker = LiveStorageTracker(MemoryCounting.BLOCKS)
    tracker.track([*module.parameters(), *module.buffers()])
    with tracker:
        run()
    return tracker.peak_bytes


def assert_same_parameters(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    for (name, want), got in zip(expected.named_parameters(), actual.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def check(planned: Planned, train: Callable[[torch.nn.Module], None]) -> None:
    """plan.module trained by `train` peaks within the budget and ends where the model does."""
    original, module = planned.copies()
    torch.manual_seed(2)
    peak_bytes = peak_while(module, lambda: train(module))
    torch.manual_seed(2)
    train(original)
    assert peak_bytes <= planned.budget_bytes, (
        f"measured {peak_bytes} over the budget {planned.budget_bytes}\n{planned.plan.summary()}"
    )
    assert_same_parameters(original, module)


# PyTorch Lightning and Fabric


def _lightning_module(model: torch.nn.Module, *, manual: bool) -> Any:
    import pytorch_lightning as pl

    class LanguageModel(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.automatic_optimization = not manual

        def training_step(self, batch: dict[str, torch.Tensor], _index: int) -> torch.Tensor:
            if self.automatic_optimization:
                return the_loss(self.model(**batch))
            optimizer = self.optimizers()
            optimizer.zero_grad()  # the recipe of Lightning's manual-optimization docs
            loss = the_loss(self.model(**batch))
            self.manual_backward(loss)
            optimizer.step()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.model.parameters(), lr=LEARNING_RATE)

        def transfer_batch_to_device(self, batch: Any, device: torch.device, index: int) -> Any:
            return _on_device(batch)

    return LanguageModel()


def _trainer(**options: Any) -> Any:
    import pytorch_lightning as pl

    return pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **options,
    )  # fmt: skip


def _fit(module: torch.nn.Module, *, manual: bool, **options: Any) -> None:
    _trainer(**options).fit(_lightning_module(module, manual=manual), _loader(BATCH, STEPS))


def test_lightning_automatic_optimization_is_planned_from_its_trainer() -> None:
    """The issue's failure: Lightning zeroes gradients between training_step and backward, so every
    forward after the first holds the last step's gradients; a plan for the plain loop refused it."""
    step = planner.TrainingStep.from_lightning(_trainer())
    assert step == planner.TrainingStep(zero_grad_before_backward=True)
    planned = plan_for(step, _batches(BATCH, 1)[0])
    check(planned, lambda module: _fit(module, manual=False))
    # What a user would plan instead, zero_grad(set_to_none=False), holds the gradients through
    # backward too: it never costs less, at any budget. Times are analytic so that both plans are
    # priced alike (measured node times move between profiling runs).
    lightning, in_place = (
        planner.profile(
            planned.model, example_kwargs=_batches(BATCH, 1)[0], loss_fn=the_loss, step=step,
            cost_model="analytic", device="cpu",
        ).plan(budget_bytes=planned.budget_bytes, solver="dp")
        for step in (step, planner.TrainingStep(zero_grad_set_to_none=False))
    )  # fmt: skip
    assert lightning.baseline_peak_bytes <= in_place.baseline_peak_bytes
    assert lightning.min_peak_bytes <= in_place.min_peak_bytes
    assert lightning.predicted_overhead <= in_place.predicted_overhead


def test_a_plain_plan_under_lightning_names_the_loop_and_the_step_to_plan() -> None:
    planned = plan_for(planner.TrainingStep(), _batches(BATCH, 1)[0])
    _, module = planned.copies()
    with pytest.raises(planner.UnplannedStep, match=r"automatic optimization.*TrainingStep\.from_lightning"):
        _fit(module, manual=False)


def test_lightning_with_accumulation_and_clipping_reads_them_from_the_trainer() -> None:
    step = planner.TrainingStep.from_lightning(_trainer(accumulate_grad_batches=2, gradient_clip_val=1.0))
    assert step == planner.TrainingStep(
        accumulation_steps=2, max_grad_norm=1.0, zero_grad_before_backward=True
    )
    planned = plan_for(step, _batches(BATCH, 1)[0])
    check(
        planned, lambda module: _fit(module, manual=False, accumulate_grad_batches=2, gradient_clip_val=1.0)
    )


def test_from_lightning_reads_the_trainer_and_refuses_what_is_not_one() -> None:
    trainer = _trainer(
        accumulate_grad_batches=3,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
        precision="bf16-mixed",
    )
    expected = planner.TrainingStep(accumulation_steps=3, zero_grad_before_backward=True)
    assert planner.TrainingStep.from_lightning(trainer) == expected  # by value: in place; bf16: no scaler
    module = _lightning_module(_gpt2(), manual=False)
    with pytest.raises(TypeError, match="attached to a Trainer; got LanguageModel"):
        planner.TrainingStep.from_lightning(module)
    module._trainer = trainer
    assert planner.TrainingStep.from_lightning(module) == expected
    with pytest.raises(TypeError, match="needs a pytorch_lightning Trainer"):
        planner.TrainingStep.from_lightning(object())


def test_lightning_manual_optimization_is_the_plain_step() -> None:
    module = _lightning_module(_gpt2(), manual=True)
    step = planner.TrainingStep.from_lightning(module)
    assert step == planner.TrainingStep()
    planned = plan_for(step, _batches(BATCH, 1)[0])
    check(planned, lambda module: _fit(module, manual=True))


def test_fabric_trains_the_plain_step() -> None:
    from lightning_fabric import Fabric

    def train(module: torch.nn.Module) -> None:
        fabric = Fabric(accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=LEARNING_RATE))
        for host in _batches(BATCH, STEPS):
            batch = _on_device(host)
            optimizer.zero_grad()
            loss = the_loss(model(**batch))
            fabric.backward(loss)
            optimizer.step()

    check(plan_for(planner.TrainingStep(), _batches(BATCH, 1)[0]), train)


# Hugging Face, accelerate and a plain loop


def _accumulating_arguments(directory: Path) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(directory), use_cpu=True, per_device_train_batch_size=BATCH // 2,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=LEARNING_RATE, report_to=[],
        save_strategy="no", seed=0, logging_steps=1,
    )  # fmt: skip


def _trainer_example() -> dict[str, Any]:
    """One micro-batch as the Trainer calls the model: with `num_items_in_batch`, a float32 scalar."""
    example = _batches(BATCH // 2, 1)[0]
    example["num_items_in_batch"] = torch.tensor(float(example["input_ids"].numel() * 2))
    return example


def test_the_hugging_face_trainer_with_accumulation(tmp_path: Path) -> None:
    from transformers import Trainer

    arguments = _accumulating_arguments(tmp_path)
    step = planner.TrainingStep.from_training_args(arguments)
    assert step == planner.TrainingStep(accumulation_steps=2, max_grad_norm=1.0)
    planned = plan_for(step, _trainer_example())

    def train(module: torch.nn.Module) -> None:
        Trainer(model=module, args=arguments, train_dataset=_samples(BATCH * STEPS)).train()

    check(planned, train)


def test_a_plain_plan_under_the_trainers_accumulation_names_from_training_args(tmp_path: Path) -> None:
    from transformers import Trainer

    _, module = plan_for(planner.TrainingStep(max_grad_norm=1.0), _trainer_example()).copies()
    trainer = Trainer(model=module, args=_accumulating_arguments(tmp_path), train_dataset=_samples(BATCH))
    with pytest.raises(planner.UnplannedStep, match=r"Hugging Face Trainer.*from_training_args"):
        trainer.train()


@contextlib.contextmanager
def _accelerator(**options: Any) -> Iterator[Any]:
    """An `Accelerator`; its state is process-wide, so it is reset for the next one."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        yield Accelerator(cpu=True, **options)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_accelerate_accumulate_is_planned_as_accumulation() -> None:
    step = planner.TrainingStep(accumulation_steps=2)
    planned = plan_for(step, _batches(BATCH // 2, 1)[0])

    def train(module: torch.nn.Module) -> None:
        with _accelerator(gradient_accumulation_steps=2) as accelerator:
            optimizer = torch.optim.Adam(module.parameters(), lr=LEARNING_RATE)
            model, optimizer = accelerator.prepare(module, optimizer)
            for host in _batches(BATCH // 2, 2 * STEPS):
                with accelerator.accumulate(model):
                    accelerator.backward(the_loss(model(**_on_device(host))))
                    optimizer.step()
                    optimizer.zero_grad()

    check(planned, train)


def test_a_torchtitan_style_loop_with_clipping() -> None:
    """zero_grad before the forward, backward, clip_grad_norm_, step: torchtitan's train loop's order."""
    step = planner.TrainingStep(max_grad_norm=1.0)
    planned = plan_for(step, _batches(BATCH, 1)[0])

    def train(module: torch.nn.Module) -> None:
        optimizer = torch.optim.Adam(module.parameters(), lr=LEARNING_RATE)
        for host in _batches(BATCH, STEPS):
            batch = _on_device(host)
            optimizer.zero_grad()
            the_loss(module(**batch)).backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()

    check(planned, train)
