"""Per-rank peaks under DDP and FSDP2: predicted by the plan, measured in each rank of a gloo group.

Why it exists: `optimize(..., world_size=N, sharding=...)` predicts one rank's memory by the rules of
planner/profiler/sharding.py (NOTE [FSDP2 per rank]); this records, for each engine, what every rank
of a real process group on this machine measures against it, for docs/memory.md. Each rank plans its
share of the batch at budgets between the lowest and the no-checkpointing peak (halfway by default), trains
`plan.module` under the engine and measures two Adam steps with `planner.measure` (planner/testing/
ranks.py, `planned_rank_step`; tests/planner/test_rank_memory.py asserts the same at 2 ranks). Run
from the repository root (about 3 minutes for 2 ranks on 2 CPU cores):

    .venv/bin/python -m bench.rank_memory [--world-size 2] [--model gpt_tiny] [--budget-fractions 0.5]

Writes `bench/results/rank_memory_<model>_<world size>.json`: a row per engine and rank with the
budget, the lowest and no-checkpointing peaks, the predicted and measured peaks (512-byte blocks) and
the measured peak per phase.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from bench.peers import machine, planner_revision
from planner.testing.ranks import ENGINES, planned_rank_step, run_ranks

log = logging.getLogger("bench.rank_memory")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"


def engine_rows(
    engine: str, world_size: int, model_name: str, budget_fraction: float
) -> list[dict[str, Any]]:
    """One row per rank of `engine`, predicted against measured."""
    rows = []
    results = run_ranks(planned_rank_step, world_size, engine, world_size, model_name, budget_fraction)
    for rank, result in enumerate(results):
        predicted, measured = result["predicted_peak_bytes"], result["measured_peak_bytes"]
        rows.append(
            {
                "engine": engine,
                **ENGINES[engine],
                "rank": rank,
                "budget_fraction": budget_fraction,
                "regions": result["regions"],
                "budget_bytes": result["budget_bytes"],
                "min_peak_bytes": result["min_peak_bytes"],
                "baseline_peak_bytes": result["baseline_peak_bytes"],
                "predicted_peak_bytes": predicted,
                "measured_peak_bytes": measured,
                "error_percent": round(100 * (measured - predicted) / predicted, 3),
                "fits": measured <= result["budget_bytes"],
                "measured_phase_peak_bytes": result["measured_phase_peak_bytes"],
            }
        )
        log.info("%s rank %d: predicted %d, measured %d", engine, rank, predicted, measured)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument(
        "--budget-fractions", default="0.5", help="comma-separated; 0 is the lowest peak, 1 no checkpointing"
    )
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rows = [
        row
        for fraction in (float(text) for text in arguments.budget_fractions.split(","))
        for engine in ENGINES
        for row in engine_rows(engine, arguments.world_size, arguments.model, fraction)
    ]
    path = RESULTS_DIRECTORY / f"rank_memory_{arguments.model}_{arguments.world_size}.json"
    report = {
        "model": arguments.model,
        "world_size": arguments.world_size,
        "backend": "gloo",
        "machine": machine(),
        "planner_revision": planner_revision(),
        "rows": rows,
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
