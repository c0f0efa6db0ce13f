"""NOTE [checkpoint's own work] in planner/profiler/selective_cost.py: the price of a checkpointed
region beyond its replay, read from the calibration chain's timed steps."""

from __future__ import annotations

import pytest

from planner.profiler.selective_cost import CHAIN_BLOCKS, CHAIN_TIMINGS, checkpoint_cost_from

OPERATORS = 80


def _timings(call_s: float, per_operator_s: float, noise_s: list[float]) -> dict[str, list[float]]:
    """Chain steps of a device whose checkpoint costs `call_s` a region and `per_operator_s` an operator,
    with each round's own drift (`noise_s`, added to every step of the round)."""
    plain_s, forward_s = 0.010, 0.004
    one_region_s = plain_s + forward_s + call_s + per_operator_s * OPERATORS
    block_regions_s = one_region_s + (CHAIN_BLOCKS - 1) * call_s
    steps = {"block_regions": block_regions_s, "one_region": one_region_s, "plain": plain_s}
    steps["forward"] = forward_s
    return {name: [steps[name] + drift for drift in noise_s] for name in CHAIN_TIMINGS}


def test_the_price_per_region_comes_from_cuts_that_replay_the_same_operators() -> None:
    timings = _timings(0.0003, 0.00002, [0.0] * 5)
    cost = checkpoint_cost_from(timings, operators=OPERATORS)
    assert cost.call_ms == pytest.approx(0.3) and cost.per_operator_ms == pytest.approx(0.02)


def test_a_round_that_drifts_moves_the_medians_only_by_what_it_shares() -> None:
    """Every step of a round drifting alike cancels in the per-round differences; one wild round out of
    five does not move a median."""
    drifting = _timings(0.0003, 0.00002, [0.0, 0.002, -0.001, 0.0005, 0.003])
    cost = checkpoint_cost_from(drifting, operators=OPERATORS)
    assert cost.call_ms == pytest.approx(0.3)
    timings = _timings(0.0003, 0.00002, [0.0] * 5)
    timings["block_regions"][2] += 0.05
    assert checkpoint_cost_from(timings, operators=OPERATORS).call_ms == pytest.approx(0.3)


def test_a_chain_that_measures_checkpointing_as_free_prices_it_at_zero_not_below() -> None:
    timings = _timings(0.0, 0.0, [0.0] * 5)
    timings["block_regions"] = [value - 0.001 for value in timings["block_regions"]]
    cost = checkpoint_cost_from(timings, operators=OPERATORS)
    assert cost.call_ms == 0.0 and cost.per_operator_ms == 0.0
