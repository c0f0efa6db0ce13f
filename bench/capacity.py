"""How far a 7B Llama-style model goes on an RTX 4090, an A100 40GB and an H100 80GB at sequence 4,096.

Why: "what batch fits my GPU?" is the question people start from. This builds the model of
`bench/plan_llama7b.py` on the meta device (no weights allocated), searches the micro-batch with
`planner.capacity` (analytic H100 times, Adam as it runs on a GPU), each card's budget its memory as
the driver reports it less the CUDA context and cuBLAS's workspaces (NOTE [card memory] and NOTE [held
back] in planner/profiler/cost_model.py), and reports per card the largest
micro-batch without and with checkpointing and the plan's predicted recompute; with `--global-batch`
it also weighs accumulation against checkpointing on the largest card. It writes
`bench/results/capacity_llama7b.{json,md}` and the picture `docs/capacity_llama7b.png`, and reports its
wall time and load average (target: under 2 minutes on the 2-core machine). docs/results.md states the
cards' rows in its own words: update it after a run.

    .venv/bin/python -m bench.capacity [--sequence 4096] [--batch-max 64]
        [--cards rtx4090,a100-40gb,h100-80gb]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import planner
from bench.plan_llama7b import LlamaConfig, LlamaStyle
from planner.errors import format_bytes
from planner.profiler.cost_model import device_spec
from planner.sizing.fitting import render_weighing

log = logging.getLogger("bench.capacity")

DEVICE = "h100-80gb"
"""The card whose rates price the step; the other cards are budgets searched on the same graphs."""


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", type=int, default=4096)
    parser.add_argument("--batch-max", type=int, default=64)
    parser.add_argument(
        "--cards", default="rtx4090,a100-40gb,h100-80gb", help="named cards (planner/profiler/cost_model.py)"
    )
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--global-batch", type=int, default=32, help="weigh accumulation on the largest card")
    parser.add_argument("--out", default="bench/results/capacity_llama7b")
    parser.add_argument("--plot", default="docs/capacity_llama7b.png", help="empty: no picture")
    return parser.parse_args()


def _loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the vocabulary in fp32, as Llama training computes it (targets: zeros)."""
    targets = torch.zeros(logits.shape[0] * logits.shape[1], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets)


def _card_budget_bytes(card: str) -> int:
    """What a step may use on `card`: its memory less what it holds back (as `device=card` plans)."""
    usable = device_spec(card).usable_memory_bytes
    if usable is None:
        raise SystemExit(f"card {card!r} does not say how much memory it has; name one that does")
    return usable


def _card_row(table: planner.Capacity, card: str) -> dict[str, Any]:
    spec = device_spec(card)
    return {
        "card": card,
        "memory_bytes": spec.memory_bytes,
        "budget_bytes": table.budget_bytes,
        "largest_without": table.largest_without,
        "largest_with": table.largest_with,
        "peak_at_largest_bytes": table.peak_at_largest,
        "overhead_at_largest": table.overhead_at_largest,
        "lowest_peak_at_smallest_bytes": table.row(table.candidates[0]).min_peak_bytes,
        "table": table.to_dict(),
    }


def _markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        f"# 7B Llama-style model, sequence {header['sequence']}, {header['optimizer']}: largest micro-batch "
        "per card",
        "",
        f"Predicted by `planner.capacity` on the meta device ({header['parameters'] / 1e9:.2f}B bf16 "
        f"parameters, times analytic for {DEVICE}); `{' '.join(header['command'])}` in "
        f"{header['wall_s']:.0f} s at load {header['load_before']} (1, 5, 15 min) on {header['machine']}.",
        "",
        "| card | memory (driver) | budget (less context and workspaces) "
        "| largest micro-batch, no checkpointing | largest micro-batch, checkpointing "
        "| predicted recompute there | plan's predicted peak |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        card = f"{row['card']} | {format_bytes(row['memory_bytes'])} | {format_bytes(row['budget_bytes'])}"
        without = row["largest_without"] or "none"
        if row["largest_with"] is None:
            lowest = format_bytes(row["lowest_peak_at_smallest_bytes"])
            with_plan = f"none (lowest peak at 1: {lowest})"
            lines.append(f"| {card} | {without} | {with_plan} | - | - |")
            continue
        lines.append(
            f"| {card} | {without} | {row['largest_with']} "
            f"| {row['overhead_at_largest']:.1%} | {format_bytes(row['peak_at_largest_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    arguments = _arguments()
    load_before = os.getloadavg()
    started = time.perf_counter()
    config = LlamaConfig(sequence=arguments.sequence)
    with torch.device("meta"):
        model = LlamaStyle(config).to(torch.bfloat16)
    parameter_count = sum(p.numel() for p in model.parameters())

    def tokens(batch: int, sequence: int) -> torch.Tensor:
        return torch.zeros(batch, sequence, dtype=torch.long, device="meta")

    def report(done: int, expected: int, message: str) -> None:
        sys.stderr.write(f"\r[{done}/{expected}] {message}   ")

    cards = sorted(arguments.cards.split(","), key=lambda card: device_spec(card).memory_bytes or 0)
    largest_card = cards[-1]
    if largest_card != DEVICE:
        raise SystemExit(
            f"--cards must end with {DEVICE}, whose rates price the step (got {arguments.cards})"
        )
    largest = planner.capacity(
        model,
        tokens,
        batch=range(1, arguments.batch_max + 1),
        sequence=arguments.sequence,
        device=DEVICE,
        optimizer=arguments.optimizer,
        loss_fn=_loss,
        global_batch=arguments.global_batch or None,
        progress=report,
    )
    tables = {
        largest_card: largest,
        **{card: largest.at_budget(budget_bytes=_card_budget_bytes(card)) for card in cards[:-1]},
    }
    rows = [_card_row(tables[card], card) for card in cards]
    if arguments.plot:
        Path(arguments.plot).parent.mkdir(parents=True, exist_ok=True)
        largest.plot(
            arguments.plot,
            title=f"7B Llama-style model, sequence {arguments.sequence}, {arguments.optimizer}",
        )
    wall_s = time.perf_counter() - started
    sys.stderr.write("\n")
    header = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": ["python", "-m", "bench.capacity", *sys.argv[1:]],
        "parameters": parameter_count,
        "sequence": arguments.sequence,
        "optimizer": arguments.optimizer,
        "timing": largest.timing,
        "wall_s": round(wall_s, 1),
        "load_before": " ".join(f"{value:.1f}" for value in load_before),
        "load_after": " ".join(f"{value:.1f}" for value in os.getloadavg()),
    }
    Path(arguments.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{arguments.out}.json").write_text(json.dumps({**header, "cards": rows}, indent=1))
    markdown = _markdown(rows, header)
    if largest.weighing is not None:
        options = "\n".join(render_weighing(largest.weighing))
        markdown += f"\nGlobal batch {arguments.global_batch} on {largest_card}:\n\n```\n{options}\n```\n"
    Path(f"{arguments.out}.md").write_text(markdown)
    sys.stdout.write(str(largest) + "\n\n" + markdown)
    sys.stdout.write(f"wall time {wall_s:.1f} s, load average before {header['load_before']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
