"""plan.module is a drop-in for the training stacks people use: the Hugging Face Trainer (a short last
batch included), an accelerate `prepare` loop and a PEFT LoRA model, with the original's losses and
gradients; it passes for the original class (signature, name, `save_pretrained`/`from_pretrained`,
state_dict keys) and refuses a second layer of checkpointing. A small GPT-2 built from a config, on
the CPU, a few steps each.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import planner
from planner.errors import LargerShapeWarning
from planner.testing.zoo_real import build_call

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("transformers", "accelerate", "peft")),
    reason="needs transformers, accelerate and peft (pip install -e '.[dev]')",
)

BATCH, SEQUENCE, SAMPLES = 4, 32, 10
"""Ten samples in batches of four: the last batch holds two."""


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).train()


def _tokens() -> torch.Tensor:
    return torch.randint(512, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(1))


def _dataset() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": row, "labels": row} for row in _tokens()]


def the_loss(output: Any) -> torch.Tensor:
    """The loss the model computes from `labels`, as the Trainer and a plain loop use it."""
    loss: torch.Tensor = output.loss
    return loss


def _training_arguments(directory: Path) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(directory),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )


@dataclass(frozen=True)
class Planned:
    model: torch.nn.Module
    """The model as it was before any training (plan.module shares its parameters: copy both)."""
    plan: planner.Plan


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Planned:
    """GPT-2 planned for the step the Trainer runs, with the call it makes: keyword inputs, the loss
    from `labels`, and `num_items_in_batch` (the Trainer passes it to a forward that takes **kwargs)."""
    directory = tmp_path_factory.mktemp("trainer")
    model = _gpt2()
    tokens = _tokens()[:BATCH]
    items = torch.tensor(float(tokens.numel()))  # the Trainer passes a float32 scalar
    example = {"input_ids": tokens, "labels": tokens, "num_items_in_batch": items}
    step = planner.TrainingStep.from_training_args(_training_arguments(directory))
    profile = planner.profile(model, example_kwargs=example, step=step, loss_fn=the_loss)
    frontier = profile.pareto(points=2, solver="dp")
    budget = (frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2
    return Planned(model=model, plan=profile.plan(budget_bytes=budget, solver="dp"))


def _copies(planned: Planned) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(a copy of the original model, a copy of plan.module), each with its own parameters."""
    assert planned.plan.module is not None
    return copy.deepcopy(planned.model), copy.deepcopy(planned.plan.module)


def test_the_planned_module_passes_for_its_class(planned: Planned, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    module = planned.plan.module
    assert module is not None and isinstance(module, GPT2LMHeadModel)
    assert inspect.signature(module.forward) == inspect.signature(planned.model.forward)
    names = (type(module).__name__, type(module).__qualname__, type(module).__module__)
    assert names == (GPT2LMHeadModel.__name__, GPT2LMHeadModel.__qualname__, GPT2LMHeadModel.__module__)
    assert list(module.state_dict()) == list(planned.model.state_dict())
    module.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    for name, expected in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], expected), name
    with pytest.raises(planner.UnsupportedModel, match="second layer of checkpointing"):
        module.gradient_checkpointing_enable()


def test_a_module_level_plan_passes_for_its_class_too() -> None:
    call = build_call("branching_root")
    plan = planner.optimize(call.model, call.args, budget_gb=1, solver="dp")
    assert plan.module is not None and type(plan.module).__name__ == type(call.model).__name__
    assert inspect.signature(plan.module.forward) == inspect.signature(call.model.forward)
    with pytest.raises(planner.UnsupportedModel, match="second layer of checkpointing"):
        plan.module.gradient_checkpointing_enable()


def _train_with_the_trainer(module: torch.nn.Module, directory: Path) -> tuple[list[float], list[float]]:
    """(losses, gradient norms) of one epoch of the Trainer, which clips gradients to 1.0 by default."""
    from transformers import Trainer

    trainer = Trainer(model=module, args=_training_arguments(directory), train_dataset=_dataset())
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [entry["loss"] for entry in steps], [entry["grad_norm"] for entry in steps]


def test_the_trainer_trains_the_plan_like_the_model_short_last_batch_included(
    planned: Planned, tmp_path: Path
) -> None:
    original, module = _copies(planned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LargerShapeWarning)
        planned_run = _train_with_the_trainer(module, tmp_path / "planned")
    original_run = _train_with_the_trainer(original, tmp_path / "original")
    assert len(planned_run[0]) == -(-SAMPLES // BATCH), "three steps, the last on a batch of two"
    losses, gradient_norms = planned_run
    assert losses == pytest.approx(original_run[0], rel=1e-6)
    assert gradient_norms == pytest.approx(original_run[1], rel=1e-5)
    for (name, expected), actual in zip(original.named_parameters(), module.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert len(module._planner_calls.entries) == 1, "the short batch ran on the one dynamic graph"


def _train_with_accelerate(module: torch.nn.Module) -> list[float]:
    from accelerate import Accelerator

    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=BATCH)
    accelerator = Accelerator(cpu=True)
    module, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    torch.manual_seed(2)
    losses = []
    for batch in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = module(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_an_accelerate_loop_trains_the_plan_like_the_model(planned: Planned) -> None:
    original, module = _copies(planned)
    assert _train_with_accelerate(module) == pytest.approx(_train_with_accelerate(original), rel=1e-6)
    for (name, expected), actual in zip(original.named_parameters(), module.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_a_lora_model_is_planned_and_trained_with_its_base_frozen() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _gpt2(), LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.1, task_type="CAUSAL_LM")
    )
    original = copy.deepcopy(model)
    tokens = _tokens()[:BATCH]
    example = {"input_ids": tokens, "labels": tokens}
    profile = planner.profile(model, example_kwargs=example, loss_fn=the_loss)
    static = profile.graph.static
    assert static.optimizer_state_bytes < 0.05 * static.parameter_bytes, "Adam keeps state for LoRA only"
    frontier = profile.pareto(points=2, solver="dp")
    budget = (frontier.min_peak_bytes + frontier.baseline_peak_bytes) // 2
    plan = profile.plan(budget_bytes=budget, solver="dp")
    assert plan.module is not None and plan.regions
    measured = planner.measure(copy.deepcopy(plan.module), example_kwargs=example, loss_fn=the_loss)
    assert measured.peak_bytes <= budget
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    assert _train_with_accelerate(plan.module) == pytest.approx(_train_with_accelerate(original), rel=1e-6)
    for (name, expected), actual in zip(original.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)
        if name in frozen:
            assert torch.equal(actual, frozen[name]), f"{name} is frozen"
