"""Fixtures shared by the torch-side tests."""

from __future__ import annotations

import functools

import pytest

from tests.planner.real_models import MidBudgetPlanner, plan_at_mid_budget


@pytest.fixture(scope="session")
def mid_budget_plan() -> MidBudgetPlanner:
    """A real-zoo entry's `dp` plan at the middle of its budget range, made once a session per entry."""
    return functools.cache(plan_at_mid_budget)
