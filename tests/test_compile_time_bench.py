"""bench/compile_time.py's table and its --models merge, on hand-made rows (nothing is compiled)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import compile_time


def row(ratio: float, **extra: object) -> dict[str, object]:
    return {
        "budget_bytes": 1, "torch_compile_s": 10.0, "torch_compile_budget_s": 11.0,
        "planned_compile_s": 10.0 * ratio, "planning_s": 0.5, "attempts": 1, "checkpointed_regions": 2,
        "ratio": ratio, **extra,
    }  # fmt: skip


def test_the_table_holds_each_model_to_twice_torch_compile_and_names_its_commit() -> None:
    table = compile_time.markdown(
        {
            "fast": row(1.5, revision="0123456789abcdef", load_average=[1.25, 1.0, 1.0]),
            "slow": row(2.5),
            "broken": {"torch_compile_s": 3.0, "refused": "graph breaks; details"},
        }
    )
    lines = table.splitlines()
    assert "| fast | 10.0 | 11.0 | 15.0 | 0.5 | 1 | 1.50 | yes | 1.2 | 0123456 |" in lines
    assert "| slow | 10.0 | 11.0 | 25.0 | 0.5 | 1 | 2.50 | **no** | — | — |" in lines
    assert "| broken | 3.0 | | refused: graph breaks | | | | | — | — |" in lines
    assert all(line.count("|") == lines[2].count("|") for line in lines[2:])


def test_a_run_with_models_keeps_the_other_models_rows(tmp_path: Path) -> None:
    out = tmp_path / "compile_time.json"
    assert compile_time._kept_results(out) == {}
    out.write_text(json.dumps({"machine": {}, "models": {"a": row(1.0), "b": row(1.2)}}))
    assert compile_time._kept_results(out) == {"a": row(1.0), "b": row(1.2)}
