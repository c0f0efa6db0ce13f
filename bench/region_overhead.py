"""What a checkpointed region costs inside a real training step, against what the planner predicts.

Why it exists: the planner prices a region as its replay (the profiled forward times of the nodes it
recomputes) plus checkpoint's own work, a part per region and a part per operator measured once per
device on a chain of tiny blocks (planner/profiler/selective_cost.py). Where that price is low, a plan of
several small regions is ranked above one of fewer, larger regions and runs slower than a hand method at
the same memory (docs/benchmark.md: BERT's three regions against Hugging Face's two on an H100). This
script measures the price where it is paid: per model, the step of the planned module with no
checkpointing against the same module with

- one node checkpointed alone, for `--probes` nodes spread over the graph (a replay that stops before
  the node's operator leaves little but checkpoint's own work);
- each hand method that can be written on the graph (`hand_schedules`: sqrt(n) segments, every block of
  each numbered container);

in interleaved rounds (one training step of each per round, Adam included, in a rotating order), for
`--seconds` per model. Each row has the predicted recompute (the simulator's, checkpoint's own work
included), the measured extra step time (the median over rounds of the step less the round's step with
no checkpointing, with its distribution-free 95 % interval) and the excess per region.

    .venv/bin/python -m bench.region_overhead [--models gpt_tiny,hf_bert,unet] [--device cuda]

Writes `bench/results/region_overhead.json` and `.md` (`--out`); docs/benchmark.md quotes the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import planner
from bench.gpu_check import Call, calls_on
from bench.peers import contender, interleaved_step_ms, machine, median_interval, planner_revision
from planner.ir import ActivationGraph, Region, RegionPolicy, Schedule, merge_stored
from planner.report.hand_checkpoints import hand_schedules
from planner.simulation.replay import checkpoint_overhead_ms
from planner.simulation.step import CheckpointRule, simulate, store_everything

log = logging.getLogger("bench.region_overhead")

DEFAULT_MODELS = ("gpt_tiny", "hf_bert", "unet")
DEFAULT_OUT = Path("bench/results/region_overhead.json")
MIN_ROUNDS = 7
"""Rounds timed however short `--seconds` is: the fewest whose median has a 95 % interval."""
MAX_ROUNDS = 401
"""Rounds timed at most, however long `--seconds` is."""


def single_node_schedules(graph: ActivationGraph, probes: int) -> dict[str, Schedule]:
    """Up to `probes` schedules that each checkpoint one node alone, the nodes spread evenly over those
    a one-node region may hold."""
    rule = CheckpointRule.of(graph)
    allowed = [index for index in range(len(graph.nodes)) if rule.allows(graph, index, index + 1)]
    if not allowed or probes < 1:
        return {}
    step = max(1, len(allowed) // probes)
    chosen = allowed[step // 2 :: step][:probes]
    schedules = {}
    for index in chosen:
        node = graph.nodes[index]
        regions = [
            Region(0, index, RegionPolicy.STORE),
            Region(index, index + 1, RegionPolicy.CHECKPOINT),
            Region(index + 1, len(graph.nodes), RegionPolicy.STORE),
        ]
        name = f"node {index} alone ({node.op}, {node.module_path or 'no module'})"
        kept = tuple(region for region in regions if region.stop > region.start)
        schedules[name] = Schedule(regions=merge_stored(list(kept)), solver=name)
    return schedules


def _row(graph: ActivationGraph, name: str, schedule: Schedule, extra_ms: list[float]) -> dict[str, Any]:
    """One schedule's predicted and measured cost (`extra_ms`: per round, its step less no checkpointing)."""
    predicted = simulate(graph, schedule)
    regions = schedule.checkpointed
    operators = sum(
        node.operator_count for region in regions for node in graph.nodes[region.start : region.stop]
    )
    measured_ms = statistics.median(extra_ms)
    interval = median_interval(extra_ms)
    return {
        "schedule": name,
        "regions": len(regions),
        "operators": operators,
        "predicted_recompute_ms": predicted.recompute_ms,
        "predicted_checkpoint_work_ms": sum(checkpoint_overhead_ms(graph, region) for region in regions),
        "measured_extra_ms": measured_ms,
        "measured_extra_interval_ms": list(interval) if interval else None,
        "excess_per_region_ms": (measured_ms - predicted.recompute_ms) / max(1, len(regions)),
        "rounds": len(extra_ms),
    }


def fitted_price(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """The price per region and per operator that fits the measured rows best: least squares of each
    row's measured checkpoint work (measured extra time less the predicted replay) on its regions and
    operators, both prices at least 0; None for fewer than two rows."""
    points = [
        (
            float(row["regions"]),
            float(row["operators"]),
            row["measured_extra_ms"] - (row["predicted_recompute_ms"] - row["predicted_checkpoint_work_ms"]),
        )
        for row in rows
        if row["regions"]
    ]
    if len(points) < 2:
        return None
    candidates = [_least_squares(points, use_regions=True, use_operators=True)]
    candidates += [_least_squares(points, use_regions=True, use_operators=False)]
    candidates += [_least_squares(points, use_regions=False, use_operators=True)]
    valid = [(call, op) for call, op in candidates if call >= 0 and op >= 0]
    call_ms, op_ms = min(valid, key=lambda price: _squared_error(points, *price))
    rms_ms = (_squared_error(points, call_ms, op_ms) / len(points)) ** 0.5
    return {"call_ms": call_ms, "op_ms": op_ms, "rms_residual_ms": rms_ms}


def _least_squares(
    points: Sequence[tuple[float, float, float]], *, use_regions: bool, use_operators: bool
) -> tuple[float, float]:
    """(per region, per operator) minimising the squared error, with the unused price held at 0."""
    rr = sum(r * r for r, _, _ in points)
    oo = sum(o * o for _, o, _ in points)
    ro = sum(r * o for r, o, _ in points)
    ry = sum(r * y for r, _, y in points)
    oy = sum(o * y for _, o, y in points)
    if use_regions and use_operators:
        determinant = rr * oo - ro * ro
        if determinant <= 0:
            return (-1.0, -1.0)
        return ((ry * oo - oy * ro) / determinant, (oy * rr - ry * ro) / determinant)
    if use_regions:
        return (ry / rr, 0.0)
    return (0.0, oy / oo)


def _squared_error(points: Sequence[tuple[float, float, float]], call_ms: float, op_ms: float) -> float:
    return sum((y - call_ms * r - op_ms * o) ** 2 for r, o, y in points)


def measure_model(call: Call, *, probes: int, seconds: float) -> dict[str, Any]:
    """Every schedule of one model timed against no checkpointing, in the same interleaved rounds."""
    profile = planner.profile(call.model, call.args, example_kwargs=call.kwargs)
    graph = profile.graph
    schedules = {**single_node_schedules(graph, probes), **hand_schedules(graph)}
    baseline = contender(
        "no checkpointing", profile.rewrite(store_everything(graph)), call.args, kwargs=call.kwargs
    )
    runners = [
        contender(name, profile.rewrite(schedule), call.args, kwargs=call.kwargs)
        for name, schedule in schedules.items()
    ]
    started = time.perf_counter()
    rounds = interleaved_step_ms(
        [baseline, *runners], rounds=MIN_ROUNDS, timing_s=seconds, max_rounds=MAX_ROUNDS
    )
    log.info(
        "%s: %d schedules, %d rounds in %.0f s",
        call.name,
        len(runners),
        rounds,
        time.perf_counter() - started,
    )
    rows = [
        _row(
            graph,
            runner.name,
            schedules[runner.name],
            [a - b for a, b in zip(runner.step_ms, baseline.step_ms, strict=True)],
        )
        for runner in runners
    ]
    return {
        "capture": graph.capture,
        "timing": graph.timing,
        "checkpoint_call_ms": graph.checkpoint_call_ms,
        "checkpoint_op_ms": graph.checkpoint_op_ms,
        "no_checkpointing_step_ms": statistics.median(baseline.step_ms),
        "fitted_price": fitted_price(rows),
        "rows": rows,
    }


def markdown(document: dict[str, Any]) -> str:
    """The results as a table per model."""
    context = document["context"]
    lines = [
        "# Checkpointed regions inside a real step: predicted against measured",
        "",
        f"{context['device']}, torch {context['machine']['torch_version']}, commit "
        f"{context['revision']['commit']}; {context['seconds']:g} s of interleaved rounds per model. "
        f"Command: `{context['command']}`",
        "",
        "Predicted: the simulator's recompute, checkpoint's own work included (its part of it in brackets). "
        "Measured: median over rounds of the step less the same round's step with no checkpointing "
        "(95 % interval).",
    ]
    for name, model in document["models"].items():
        if "error" in model:
            lines += ["", f"## {name}", "", f"failed: {model['error']}"]
            continue
        lines += [
            "",
            f"## {name}",
            "",
            f"Capture {model['capture']}; no checkpointing {model['no_checkpointing_step_ms']:.2f} ms a "
            f"step; checkpoint's own work priced at {model['checkpoint_call_ms']:.3f} ms a region and "
            f"{model['checkpoint_op_ms']:.4f} ms an operator.{_fitted_text(model.get('fitted_price'))}",
            "",
            "| schedule | regions | operators | predicted ms (own work) | measured ms (95 % interval) | "
            "excess per region ms |",
            "|---|---|---|---|---|---|",
        ]
        for row in model["rows"]:
            interval = row["measured_extra_interval_ms"]
            spread = f" ({interval[0]:.2f} to {interval[1]:.2f})" if interval else ""
            lines.append(
                f"| {row['schedule']} | {row['regions']} | {row['operators']} | "
                f"{row['predicted_recompute_ms']:.2f} ({row['predicted_checkpoint_work_ms']:.2f}) | "
                f"{row['measured_extra_ms']:.2f}{spread} | {row['excess_per_region_ms']:+.2f} |"
            )
    return "\n".join(lines) + "\n"


def _fitted_text(price: dict[str, float] | None) -> str:
    if price is None:
        return ""
    return (
        f" The rows fit best at {price['call_ms']:.3f} ms a region and {price['op_ms']:.4f} ms an operator "
        f"(root mean square residual {price['rms_residual_ms']:.2f} ms)."
    )


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo or real-zoo names"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--probes", type=int, default=4, help="nodes checkpointed alone, one schedule each")
    parser.add_argument("--seconds", type=float, default=60.0, help="interleaved timing per model")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("planner").setLevel(logging.WARNING)
    device = torch.device(arguments.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as bench.compare times its steps
    names = tuple(name for name in arguments.models.split(",") if name)
    models: dict[str, Any] = {}
    for call in calls_on(names, device):
        try:
            models[call.name] = measure_model(call, probes=arguments.probes, seconds=arguments.seconds)
        except Exception as error:  # one model's failure is a row, not the end of the run
            log.exception("%s failed", call.name)
            models[call.name] = {"error": f"{type(error).__name__}: {error}"}
    document = {
        "context": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "machine": machine(),
            "revision": planner_revision(),
            "seconds": arguments.seconds,
            "probes": arguments.probes,
            "command": "python -m bench.region_overhead "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "models": models,
    }
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(document, indent=2) + "\n")
    arguments.out.with_suffix(".md").write_text(markdown(document))
    sys.stdout.write(markdown(document))
    return 0 if all("error" not in model for model in models.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
