"""What counting as a GPU counts changes: every zoo model's peaks in exact bytes, in 512-byte blocks, and
reserved by the caching allocator model, and one model that an exact-bytes plan overruns.

Why it exists: docs/memory.md quotes these figures; this is the command that reproduces them. Peaks of
the zoo are predicted (analytic costs on the "cpu" spec, so that the run is quick and the same every
time; the fidelity tests measure predictions in blocks to the byte). The last model, a GroupNorm net of
odd sizes not in any zoo (planner/testing/odd_sizes.py), is also measured: the plan made in exact
bytes at its lowest peak, and the plan made in blocks at its own, each in both countings.

    .venv/bin/python -m bench.device_memory            # about 15 s on a 2-core CPU

Writes bench/results/device_memory.json and the markdown table beside it (also printed).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import planner
from planner.testing.odd_sizes import odd_net
from planner.zoo import FIDELITY_ZOO, build_model

DEFAULT_OUT = Path("bench/results/device_memory.json")
ODD_NET = "odd_groupnorm_net"


def _row(name: str) -> dict[str, Any]:
    model, inputs = odd_net() if name == ODD_NET else build_model(name)
    peaks: dict[str, Any] = {"model": name}
    for counting in ("exact", "blocks"):
        profiled = planner.profile(
            model, inputs, cost_model="analytic", device="cpu", memory_counting=counting
        )
        reference = profiled.plan(budget_bytes=2**40, budget_kind="allocated")
        peaks[f"baseline_{counting}_bytes"] = reference.baseline_peak_bytes
        peaks[f"lowest_{counting}_bytes"] = reference.min_peak_bytes
        if counting == "blocks":
            lowest = profiled.plan(budget_bytes=reference.min_peak_bytes, budget_kind="allocated")
            for label, plan in (("baseline", reference), ("lowest", lowest)):
                peaks[f"{label}_reserved_bytes"] = plan.reserved.reserved_peak_bytes
                peaks[f"{label}_expandable_reserved_bytes"] = plan.reserved.expandable_reserved_peak_bytes
    return peaks


def _overrun() -> dict[str, Any]:
    """The odd net planned at its lowest peak in each counting, measured in both."""
    model, inputs = odd_net()
    measured: dict[str, Any] = {}
    for counting in ("exact", "blocks"):
        budget = planner.optimize(model, inputs, budget_bytes=2**40, memory_counting=counting).min_peak_bytes
        plan = planner.optimize(model, inputs, budget_bytes=budget, memory_counting=counting)
        step = planner.measure(copy.deepcopy(plan.module), inputs)
        measured[counting] = {
            "budget_bytes": budget,
            "predicted_bytes": plan.predicted_peak_bytes,
            "measured_exact_bytes": step.exact_peak_bytes,
            "measured_blocks_bytes": step.peak_bytes,
        }
    return measured


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | no checkpointing, exact | in blocks | blocks over exact | lowest peak, exact | in blocks "
        "| reserved, no checkpointing: default / expandable | reserved at the lowest peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        over = row["baseline_blocks_bytes"] / row["baseline_exact_bytes"] - 1
        lines.append(
            f"| {row['model']} | {row['baseline_exact_bytes']:,} | {row['baseline_blocks_bytes']:,} "
            f"| {over:.2%} | {row['lowest_exact_bytes']:,} | {row['lowest_blocks_bytes']:,} "
            f"| {row['baseline_reserved_bytes']:,} / {row['baseline_expandable_reserved_bytes']:,} "
            f"| {row['lowest_reserved_bytes']:,} / {row['lowest_expandable_reserved_bytes']:,} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    description = __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m bench.device_memory", description=description)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    arguments = parser.parse_args(argv)
    rows = [_row(name) for name in (*FIDELITY_ZOO, ODD_NET)]
    document = {"rows": rows, "odd_net_overrun": _overrun()}
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(document, indent=1))
    table = "\n".join(_table(rows))
    arguments.out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(json.dumps(document["odd_net_overrun"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
