"""The measured timeline: per-operator live bytes of a real steady-state step, in phase order."""

from __future__ import annotations

import copy

import torch

import planner
from planner.profiler.measurement import measure_timeline

PHASES = ("forward", "backward", "optimizer step")


def small_model() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    return model, (torch.randn(128, 64),)


def test_samples_come_in_phase_order_and_peak_like_the_measured_step() -> None:
    model, inputs = small_model()
    timeline = measure_timeline(copy.deepcopy(model), inputs)
    phases = [phase for phase, _ in timeline.samples]
    assert set(phases) == set(PHASES)
    assert phases == sorted(phases, key=PHASES.index), "phases interleave"
    measured = planner.measure(copy.deepcopy(model), inputs)
    assert timeline.peak_bytes == max(live_bytes for _, live_bytes in timeline.samples)
    # Operators' internal temporaries are invisible per operator, so the timeline may peak lower.
    assert 0.9 * measured.peak_bytes <= timeline.peak_bytes <= measured.peak_bytes
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Steady state: parameters and Adam's two states are live from the first sample on.
    assert timeline.samples[0][1] >= 3 * parameter_bytes


def test_the_model_trains_and_the_original_is_untouched_when_copied() -> None:
    model, inputs = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    trained = copy.deepcopy(model)
    measure_timeline(trained, inputs, optimizer="sgd")
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert not all(torch.equal(b, p) for b, p in zip(before, trained.parameters(), strict=True))
