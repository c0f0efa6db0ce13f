"""bench/solvers.py's rank correlation and its target lines (the benchmark itself asserts nothing)."""

from __future__ import annotations

import pytest

from bench import solvers as solvers_bench


def test_spearman_ranks_ties_together_and_reverses_sign() -> None:
    assert solvers_bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert solvers_bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties share their mean rank: ranks (0.5, 0.5, 2, 3) against (0, 1, 2, 3).
    assert solvers_bench.spearman([5, 5, 6, 7], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


def test_too_few_operators_are_not_ranked_and_the_pooled_row_is_judged_on_its_own() -> None:
    two = [(1.0, 2.0), (2.0, 1.0)]
    agreeing = [(float(i), float(i) + 0.5) for i in range(6)]
    correlations = [
        solvers_bench._correlation("tiny", two, two),
        solvers_bench._correlation("mlp", agreeing, agreeing),
        solvers_bench._correlation(solvers_bench.POOLED, two + agreeing, two + agreeing),
    ]
    assert correlations[0]["spearman_distinct"] is None
    assert correlations[1]["spearman_distinct"] == 1.0
    lines = solvers_bench.targets([], correlations)
    assert "- Spearman >= 0.8 over distinct operators on every zoo model: met (lowest 1.000, mlp)" in lines
    pooled = correlations[2]["spearman_distinct"]
    assert any(
        line.startswith("- Spearman >= 0.8 over the zoo's 8 distinct operators pooled:") for line in lines
    )
    assert (f"({pooled:.3f})" in lines[-1]) and (("met" in lines[-1]) == (pooled >= 0.8))
    assert "n/a (2 operators)" in solvers_bench.markdown([], correlations)
