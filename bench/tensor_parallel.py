"""Per-rank plans under tensor parallelism, measured in gloo process groups on the CPU.

Why it exists: issue 37 asks that a model split by `parallelize_module` get a plan on every rank whose
predicted peak is within 2 % of what that rank measures. tests/planner/test_tensor_parallel.py checks it
at two budgets on 2 ranks; this script records the figures the docs quote, on 2 and 4 ranks, with the
blocks split alone (`megatron_plan`) and with the embedding and output projection split too (`ends`).
For each rank:

- the measured peak of the unplanned tensor parallel step (live-storage tracker, 512-byte blocks), and
  the same step counted from the CPU allocator's own events (which see inside DTensor's dispatch);
- `checkpoint_wrapper` on every block (the hand method), measured;
- the plan at its lowest achievable peak and at a third and two thirds of the way to the unplanned
  peak: predicted and measured peak, checkpointed regions, and whether loss and gradients equal the
  unplanned run's bit for bit;
- whether every rank got the same schedule.

Run from the repository root (about 2 min on 2 CPU cores):

    .venv/bin/python -m bench.tensor_parallel [--world-sizes 2,4]

Writes `bench/results/tensor_parallel.json` and `bench/results/tensor_parallel.md`; docs/usage.md
("Tensor parallelism") quotes them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.peers import machine, planner_revision
from planner.testing.ranks import run_ranks
from planner.testing.tensor_parallel import BATCH, SEQUENCE, tensor_parallel_rank_step

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
FRACTIONS = (0.0, 1 / 3, 2 / 3)
"""Budgets, as the fraction of the way from the lowest achievable peak to the unplanned one."""


def run_case(world_size: int, ends: bool) -> dict[str, Any]:
    """Every rank's report (`tensor_parallel_rank_step`) for `world_size` ranks, and whether they agree."""
    ranks = run_ranks(tensor_parallel_rank_step, world_size, world_size, FRACTIONS, ends, True)
    schedules = {tuple(plan["schedule"] for plan in row["plans"]) for row in ranks}
    return {
        "world_size": world_size,
        "split": "blocks, embedding and output" if ends else "blocks",
        "same_schedule_on_every_rank": len(schedules) == 1,
        "ranks": ranks,
    }


def _summary(cases: list[dict[str, Any]]) -> list[str]:
    """One row per case: the first rank's peaks and the worst over every rank and budget."""
    lines = [
        "| ranks | split | unplanned | every block | lowest predicted | lowest measured | worst error | "
        "all fit | grads equal | same schedule |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        plans = [plan for row in case["ranks"] for plan in row["plans"]]
        first = case["ranks"][0]
        worst = max(abs(p["measured_bytes"] - p["predicted_bytes"]) / p["predicted_bytes"] for p in plans)
        cells = [
            case["world_size"],
            case["split"],
            f"{first['unplanned_bytes']:,}",
            f"{first['every_block_bytes']:,}",
            f"{first['plans'][0]['predicted_bytes']:,}",
            f"{first['plans'][0]['measured_bytes']:,}",
            f"{worst:.3%}",
            all(p["measured_bytes"] <= p["budget_bytes"] for p in plans),
            all(p["loss_and_gradients_equal"] for p in plans),
            case["same_schedule_on_every_rank"],
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return lines


def _per_rank(cases: list[dict[str, Any]]) -> list[str]:
    """One row per rank and budget."""
    lines = [
        "| ranks | split | rank | unplanned | (allocator) | every block | budget | predicted | measured | "
        "error | regions | grads equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        for row in case["ranks"]:
            for plan in row["plans"]:
                predicted, measured = plan["predicted_bytes"], plan["measured_bytes"]
                cells = [
                    case["world_size"],
                    case["split"],
                    row["rank"],
                    f"{row['unplanned_bytes']:,}",
                    f"{row['unplanned_allocator_bytes']:,}",
                    f"{row['every_block_bytes']:,}",
                    f"{plan['budget_bytes']:,}",
                    f"{predicted:,}",
                    f"{measured:,}",
                    f"{(measured - predicted) / predicted:+.3%}",
                    plan["regions"],
                    plan["loss_and_gradients_equal"],
                ]
                lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return lines


def _table(cases: list[dict[str, Any]], unsplit_bytes: int) -> str:
    lines = [
        "# Tensor parallel plans, measured per rank (gloo, CPU)",
        "",
        "LlamaStack (4 blocks, width 128, 4 heads, SwiGLU 352, vocabulary 256), tokens "
        f"({BATCH}, {SEQUENCE}), Adam, cross-entropy; one process without TP measures "
        f"{unsplit_bytes:,} B unplanned. Bytes in 512-byte blocks, measured by the live-storage tracker "
        "inside each rank (`planner.measure`); `python -m bench.tensor_parallel`. Budgets: the lowest "
        "achievable peak, and a third and two thirds of the way from it to the unplanned peak. 'every "
        "block' is `checkpoint_wrapper` on every block; '(allocator)' the unplanned step counted from the "
        "CPU allocator's events, which also count buffers gloo allocates for the all-reduces (no tensor "
        "of the step), on some ranks in some runs.",
        "",
        *_summary(cases),
        "",
        *_per_rank(cases),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated numbers of ranks")
    arguments = parser.parse_args()
    cases = [
        run_case(int(world_size), ends)
        for world_size in arguments.world_sizes.split(",")
        for ends in (False, True)
    ]
    unsplit_bytes = cases[0]["ranks"][0]["unsplit_bytes"]
    RESULTS_DIRECTORY.mkdir(exist_ok=True)
    result = {
        "machine": machine(),
        "planner": planner_revision(),
        "unsplit_unplanned_bytes": unsplit_bytes,
        "cases": cases,
    }
    (RESULTS_DIRECTORY / "tensor_parallel.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS_DIRECTORY / "tensor_parallel.md").write_text(_table(cases, unsplit_bytes))


if __name__ == "__main__":
    main()
