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
import copy
import functools
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import planner
from bench.peers import machine, planner_revision
from planner.profiler.measurement import _allocator_peaks, _train_step, make_optimizer
from planner.testing.tensor_parallel import Block, LlamaConfig, LlamaStack, parallelize_megatron
from planner.testing.zoo_dag import checkpoint_every_instance

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
SEED = 1234
BATCH, SEQUENCE = 4, 64
FRACTIONS = (0.0, 1 / 3, 2 / 3)
"""Budgets, as the fraction of the way from the lowest achievable peak to the unplanned one."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _loss(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _gradients(module: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = _loss(tokens, module(tokens))
    loss.backward()
    gradients = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return loss.item(), [g for g in gradients if g is not None]


def _allocator_peak_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    optimizer = make_optimizer("adam", list(model.parameters()))
    loss_fn = functools.partial(_loss, tokens)
    run = functools.partial(
        _train_step, model, (tokens,), {}, loss_fn, optimizer, step=planner.TrainingStep(), scaler=None
    )
    peaks = _allocator_peaks(run, [*model.parameters()])
    peaks.phase_bytes.pop("start", None)
    return max(peaks.phase_bytes.values())


def _rank(rank: int, world_size: int, ends: bool, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(SEED)
        base = LlamaStack(LlamaConfig())
        tokens = torch.randint(LlamaConfig().vocabulary_size, (BATCH, SEQUENCE))
        loss_fn = functools.partial(_loss, tokens)
        unplanned = parallelize_megatron(copy.deepcopy(base), mesh, ends=ends)
        expected_loss, expected = _gradients(unplanned, tokens)
        unplanned_bytes = planner.measure(copy.deepcopy(unplanned), (tokens,), loss_fn=loss_fn).peak_bytes
        hand = checkpoint_every_instance(unplanned, Block)
        hand_bytes = planner.measure(hand, (tokens,), loss_fn=loss_fn).peak_bytes
        model = parallelize_megatron(copy.deepcopy(base), mesh, ends=ends)
        profile = planner.profile(model, (tokens,), loss_fn=loss_fn, tensor_parallel=mesh)
        lowest = profile.plan(budget_bytes=2**40).min_peak_bytes
        plans = []
        for fraction in FRACTIONS:
            budget = lowest + int(fraction * (unplanned_bytes - lowest))
            plan = profile.plan(budget_bytes=budget)
            assert plan.module is not None
            loss, gradients = _gradients(plan.module, tokens)
            measured = planner.measure(copy.deepcopy(plan.module), (tokens,), loss_fn=loss_fn)
            plans.append(
                {
                    "budget_bytes": budget,
                    "predicted_bytes": plan.predicted_peak_bytes,
                    "measured_bytes": measured.peak_bytes,
                    "regions": len(plan.schedule.checkpointed),
                    "schedule": repr(plan.schedule.regions),
                    "loss_and_gradients_equal": loss == expected_loss
                    and all(torch.equal(a, b) for a, b in zip(gradients, expected, strict=True)),
                }
            )
        row = {
            "rank": rank,
            "unplanned_bytes": unplanned_bytes,
            "unplanned_allocator_bytes": _allocator_peak_bytes(copy.deepcopy(unplanned), tokens),
            "every_block_bytes": hand_bytes,
            "capture": profile.graph.capture,
            "plans": plans,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


def _unsplit_bytes() -> int:
    """The unplanned step of the whole model in one process: what one device holds without TP."""
    torch.manual_seed(SEED)
    model = LlamaStack(LlamaConfig())
    tokens = torch.randint(LlamaConfig().vocabulary_size, (BATCH, SEQUENCE))
    return planner.measure(model, (tokens,), loss_fn=functools.partial(_loss, tokens)).peak_bytes


def run_case(world_size: int, ends: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank, args=(world_size, ends, _free_port(), out), nprocs=world_size, start_method="spawn"
        )
        ranks = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(world_size)]
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
    unsplit_bytes = _unsplit_bytes()
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
