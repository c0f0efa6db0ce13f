"""Per-stage plans against one checkpointing policy for every stage, on a CPU pipeline, measured.

Why it exists: under 1F1B the first stage holds as many micro-batches in flight as there are stages
and the last holds one, so one policy for every stage (`checkpoint_wrapper` on every block, or on the
first k blocks of each stage, as Megatron's `recompute_num_layers` does) either recomputes where
memory was free or overflows the first stage. This script runs the small transformer of
planner/testing/pipeline_stages.py as a real `Schedule1F1B` (and `ScheduleGPipe`) in gloo processes
on the CPU, one per stage, at one per-device budget (a fraction of the unplanned pipeline's highest
predicted stage peak), and records for each policy every rank's measured peak (512-byte blocks,
everything alive at the step's start counted, one run per policy) and whether it fits, and step
times (barrier to barrier: the slowest rank's) of every policy in one run, in interleaved rounds in a
rotating order, with the median over rounds of each policy's time over the per-stage plans' in the
same round (NOTE [timing noise] in bench/peers.py: the CPU's speed drifts over seconds). The hand
policy to compare with is the smallest k whose every stage fits, measured.

    .venv/bin/python -m bench.pipeline [--rounds 15]

Writes bench/results/pipeline.json; README.md and docs/benchmark.md quote it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.peers import machine, planner_revision
from planner.testing.pipeline_stages import (
    PipelineConfig,
    RankRecord,
    StageWrapper,
    checkpointed_blocks,
    plan_pipeline,
    planned_stage,
    run_pipeline,
    time_pipelines,
)

log = logging.getLogger(__name__)

PLANS = "per-stage plans"
EVERY_BLOCK = "checkpoint_wrapper on every block"
RESULTS = Path(__file__).parent / "results" / "pipeline.json"
BUDGET_FRACTION = 0.75
"""The per-device budget as a fraction of the unplanned pipeline's highest predicted stage peak."""
CONFIGS = (
    PipelineConfig(stages=2, blocks=8, schedule="1f1b"),
    PipelineConfig(stages=2, blocks=8, schedule="gpipe"),
    PipelineConfig(stages=4, ranks=2, blocks=8, schedule="interleaved_1f1b"),
)


def _row(
    policy: str, records: list[RankRecord], budget: int, predicted: list[int] | None = None
) -> dict[str, Any]:
    peaks = [record.peak_bytes for record in records]
    return {
        "policy": policy,
        "measured_peak_bytes": peaks,
        "predicted_peak_bytes": predicted,
        "fits": all(peak <= budget for peak in peaks),
    }


def _policies(config: PipelineConfig, budget: int) -> dict[str, StageWrapper | None]:
    """Every policy compared, by name: none, the per-stage plans, and checkpoint_wrapper on the first k
    blocks of each stage for every k (k = all: every block)."""
    per_stage = config.blocks // config.stages
    policies: dict[str, StageWrapper | None] = {
        "none": None,
        PLANS: functools.partial(planned_stage, config, budget),
    }
    for first in range(1, per_stage + 1):
        name = EVERY_BLOCK if first == per_stage else f"checkpoint_wrapper on first {first}"
        policies[name] = functools.partial(checkpointed_blocks, first)
    return policies


def bench_config(config: PipelineConfig, rounds: int) -> dict[str, Any]:
    """Every policy of one pipeline at one budget: peaks measured one policy per run, step times in
    interleaved rounds of all of them in one run."""
    unplanned = plan_pipeline(config, 2**40)
    budget = int(BUDGET_FRACTION * max(report.predicted_peak_bytes for report in unplanned.stages))
    pipeline = plan_pipeline(config, budget)
    policies = _policies(config, budget)
    rows = []
    for name, wrapper in policies.items():
        predicted = [r.predicted_peak_bytes for r in pipeline.stages] if name == PLANS else None
        rows.append(_row(name, run_pipeline(config, wrapper), budget, predicted))
    fitting_hand = [
        row["policy"] for row in rows if row["fits"] and row["policy"].startswith("checkpoint_wrapper")
    ]
    times = time_pipelines(config, policies, rounds=rounds)
    for row in rows:
        row["step_ms_median"] = statistics.median(times[row["policy"]])
        row["step_time_over_plans"] = statistics.median(
            a / b for a, b in zip(times[row["policy"]], times[PLANS], strict=True)
        )
        row["smallest_k_that_fits"] = bool(fitting_hand) and row["policy"] == fitting_hand[0]
    return {
        "config": dataclasses.asdict(config),
        "budget_bytes": budget,
        "plan_summary": pipeline.summary(),
        "rounds": rounds,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    results = {
        "machine": machine(),
        "revision": planner_revision(),
        "pipelines": [bench_config(config, args.rounds) for config in CONFIGS],
    }
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    for entry in results["pipelines"]:
        log.info("%s", entry["plan_summary"])
        for row in entry["rows"]:
            log.info(
                "  %-36s peaks %s fits %s, %.1f ms, %.3fx the plans'",
                row["policy"],
                row["measured_peak_bytes"],
                row["fits"],
                row["step_ms_median"],
                row["step_time_over_plans"],
            )


if __name__ == "__main__":
    main()
