"""The torch-free half of planner.capacity (planner/sizing/fitting.py): bisection against an oracle, the
monotonicity check, and the weighing of checkpointing, accumulation and bf16 on known costs."""

from __future__ import annotations

import math
import random

import pytest

from planner.sizing.fitting import (
    Priced,
    SizeRow,
    check_monotone,
    divisors,
    largest_fitting,
    render_weighing,
    weigh,
)


@pytest.mark.parametrize("seed", range(20))
def test_bisection_finds_the_end_of_the_fitting_prefix_in_few_probes(seed: int) -> None:
    generator = random.Random(seed)
    candidates = sorted(generator.sample(range(1, 1000), generator.randint(1, 60)))
    limit = generator.choice([0, *candidates, 1000])
    probes: list[int] = []

    def fits(size: int) -> bool:
        probes.append(size)
        return size <= limit

    expected = max((size for size in candidates if size <= limit), default=None)
    assert largest_fitting(candidates, fits) == expected
    assert len(probes) <= 2 + math.ceil(math.log2(len(candidates)))
    assert largest_fitting(candidates, lambda size: size <= limit, scan=True) == expected


def test_scan_finds_a_fitting_size_that_bisection_would_miss_when_fit_is_not_monotone() -> None:
    fitting = {1, 2, 3, 7}
    candidates = list(range(1, 9))
    assert largest_fitting(candidates, fitting.__contains__, scan=True) == 7
    assert largest_fitting(candidates, fitting.__contains__) == 3


def test_an_inversion_among_the_probed_sizes_is_reported() -> None:
    rows = [
        SizeRow(8, baseline_peak_bytes=100, min_peak_bytes=50, step_ms=1.0, source="captured"),
        SizeRow(16, baseline_peak_bytes=200, min_peak_bytes=40, step_ms=2.0, source="captured"),
    ]
    message = check_monotone(rows, "batch")
    assert message is not None and "lowest peak falls" in message and "search='scan'" in message
    assert check_monotone(rows[:1], "batch") is None


MIB = 2**20


def _price(*, per_sample_bytes: int, static_bytes: int, accumulated_bytes: int, fixed_ms: float):  # type: ignore[no-untyped-def]
    """A made-up model: activations linear in the micro-batch (a plan keeps a quarter of them at 30 %
    recompute), gradients alive from the second micro-batch on, and a fixed cost per micro-batch."""

    def priced(micro_batch: int, steps: int, checkpointing: bool) -> Priced:
        resident = static_bytes + (accumulated_bytes if steps > 1 else 0)
        baseline = resident + per_sample_bytes * micro_batch
        lowest = resident + per_sample_bytes * micro_batch // 4
        compute_ms = fixed_ms + micro_batch
        if not checkpointing:
            return Priced(baseline, baseline <= budget, compute_ms, 0.0)
        return Priced(lowest, lowest <= budget, compute_ms, 0.3 * compute_ms if lowest <= budget else 0.0)

    budget = 40 * MIB
    return priced


def test_accumulation_wins_when_micro_batches_cost_little_more_per_sample() -> None:
    price = _price(per_sample_bytes=MIB, static_bytes=6 * MIB, accumulated_bytes=6 * MIB, fixed_ms=1.0)
    weighing = weigh(64, {"": price}, budget_bytes=40 * MIB, where="on a test card")
    described = [option.describe() for option in weighing.options]
    assert described == [
        "a batch of 64 as it is",
        "checkpointing a batch of 64",
        "accumulating 4 micro-batches of 16",
        "accumulating 2 micro-batches of 32 with checkpointing",
    ]
    assert weighing.best is not None and weighing.best.describe() == "accumulating 4 micro-batches of 16"
    # 16 fits with every gradient alive (6 + 6 + 16 MiB); 32 would not (44 MiB), though it fits alone.
    assert price(32, 1, False).fits and not price(32, 2, False).fits
    # 4 x (1 + 16) ms against (1 + 64) x 1.3 ms for the same 64 samples.
    faster = (1 + 64) * 1.3 / (4 * (1 + 16)) - 1
    assert weighing.recommendation.startswith(
        f"accumulating 4 micro-batches of 16 is predicted {faster * 100:.0f} % faster than checkpointing a "
        "batch of 64 on a test card"
    )
    assert "recomputes 30.0% of its forward and backward" in weighing.recommendation
    assert "* accumulating 4 micro-batches of 16" in "\n".join(render_weighing(weighing))


def test_checkpointing_wins_when_small_micro_batches_are_slow() -> None:
    price = _price(per_sample_bytes=MIB, static_bytes=6 * MIB, accumulated_bytes=6 * MIB, fixed_ms=200.0)
    weighing = weigh(64, {"": price}, budget_bytes=40 * MIB, where="on a test card")
    assert weighing.best is not None and weighing.best.describe() == "checkpointing a batch of 64"
    assert "faster than accumulating" in weighing.recommendation


def test_the_batch_as_it_is_needs_nothing_else_and_nothing_fitting_is_said() -> None:
    roomy = _price(per_sample_bytes=1024, static_bytes=MIB, accumulated_bytes=MIB, fixed_ms=1.0)
    both = {"": roomy, "bf16 autocast": roomy}
    weighing = weigh(8, both, budget_bytes=40 * MIB, where="on a test card")
    assert [option.describe() for option in weighing.options] == [
        "a batch of 8 as it is",
        "a batch of 8 as it is under bf16 autocast",
    ]
    full = _price(per_sample_bytes=MIB, static_bytes=45 * MIB, accumulated_bytes=MIB, fixed_ms=1.0)
    weighing = weigh(8, {"": full}, budget_bytes=40 * MIB, where="on a test card")
    assert weighing.best is None and weighing.recommendation.startswith("nothing fits on a test card")
    with pytest.raises(ValueError, match="global_batch must be a positive int"):
        weigh(0, {"": full}, budget_bytes=40 * MIB, where="on a test card")


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]


def test_the_recommendation_also_names_checkpointing_the_whole_batch() -> None:
    budget = 40 * MIB

    def price(micro_batch: int, steps: int, checkpointing: bool) -> Priced:
        """Recompute grows with how far the micro-batch is over the budget (at most 30 %)."""
        baseline = 6 * MIB + (6 * MIB if steps > 1 else 0) + MIB * micro_batch
        compute_ms = 1.0 + micro_batch
        if not checkpointing:
            return Priced(baseline, baseline <= budget, compute_ms, 0.0)
        share = min(0.3, (baseline - budget) / baseline)
        return Priced(budget, True, compute_ms, share * compute_ms)

    weighing = weigh(64, {"": price}, budget_bytes=budget, where="on a test card")
    assert weighing.best is not None and weighing.best.describe() == "accumulating 4 micro-batches of 16"
    whole = (64 / (65 * 1.3)) * 1e3
    best = 64 / (4 * 17) * 1e3
    assert (
        "faster than accumulating 2 micro-batches of 32 with checkpointing on a test card"
        in weighing.recommendation
    )
    assert (
        f", and {(best / whole - 1) * 100:.0f} % faster than checkpointing a batch of 64 ({whole:.4g})"
        in weighing.recommendation
    )
