"""Compile time of a planned model (`planner.optimize(..., compile=True)`) beside `torch.compile`'s own.

Why it exists: planning the compiled step happens inside the compile (planner/compiled/optimize.py), so
its cost is paid every time a model is compiled; the issue's bound is that planning must not more than
double the compile. Each measurement runs in a fresh interpreter with an empty inductor cache directory and
inductor's FX-graph and AOT-autograd caches off, so every kernel is generated and built again (cold):

- torch.compile: `torch.compile(model)`, then the first forward and backward on the example inputs,
  less a second (warm) forward and backward: the seconds dynamo, AOT autograd and inductor spent; also
  with `activation_memory_budget=0.5`, whose backward recomputes and so has more kernels to build;
- planned: `planner.optimize(model, inputs, budget_bytes=B, compile=True)`, less a warm forward and
  backward of `plan.module`. It includes everything `optimize` does: the optimizer probe, the loss's
  measurement, the partitioner's planning, the compile, and the forward and backward it measures to
  check the budget (NOTE [checked budget]), and any compilation made again.

B is the budget halfway between the planned lowest peak and the planned peak without checkpointing,
found first in a third interpreter without compiling (`plan_compiled_step`).

    .venv/bin/python -m bench.compile_time                       # the compare bench's models
    .venv/bin/python -m bench.compile_time --models gpt_tiny,unet --out /tmp/compile_time.json

Results: JSON at `--out` (default bench/results/compile_time.json) and a markdown table beside it, which
docs/compiled.md quotes (bench/docs_tables.py). Each
model's row records the commit it measured and the machine's load average when it started: timings on
a shared machine are noisy. With `--models` the other models' rows of an existing `--out` are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import planner
from bench.compare import MODELS, build_example
from bench.compare_measurement import log_methods
from bench.docs_tables import refresh_quotes
from bench.peers import machine, planner_revision
from planner.compiled.optimize import plan_compiled_step
from planner.errors import UnsupportedModel
from planner.ir import TrainingStep
from planner.profiler.measurement import default_loss

RESULTS = Path(__file__).resolve().parent / "results"
MID_FRACTION = 0.5
PEER_PERCENT = 50
"""torch.compile is also timed at activation_memory_budget=0.5: a compile that recomputes in backward
generates kernels for the recomputation too, whoever chose it."""
MAX_RATIO = 2.0
"""The bound: planned compile time at most twice torch.compile's."""
WORKER_TIMEOUT_S = 1800


def _forward_backward(module: torch.nn.Module, call: Any) -> float:
    """Seconds of one forward and backward (gradients accumulate; nothing here reads them)."""
    started = time.perf_counter()
    default_loss(module(*call.args, **call.kwargs)).backward()
    return time.perf_counter() - started


def _torch_compile_s(name: str, percent: int = 100) -> dict[str, Any]:
    """torch.compile's compile time, at `activation_memory_budget` = `percent` / 100 (100: its default)."""
    call = build_example(name, "cpu")
    with torch._functorch.config.patch(activation_memory_budget=percent / 100):
        module = torch.compile(call.model)
        first_s = _forward_backward(module, call)
    return {"compile_s": first_s - _forward_backward(module, call)}


def _planned_budget(name: str) -> dict[str, Any]:
    call = build_example(name, "cpu")
    try:
        plan = plan_compiled_step(
            call.model, call.args, call.kwargs, budget_bytes=2**40, optimizer="adam", step=TrainingStep(),
            loss_fn=default_loss, solver="auto", device=None,
        )  # fmt: skip
    except UnsupportedModel as refused:
        return {"refused": str(refused)}
    lowest, baseline = plan.min_peak_bytes, plan.baseline_peak_bytes
    return {"budget_bytes": int(lowest + MID_FRACTION * (baseline - lowest))}


def _planned_compile_s(name: str, budget_bytes: int) -> dict[str, Any]:
    call = build_example(name, "cpu")
    started = time.perf_counter()
    plan = planner.optimize(
        call.model, call.args, example_kwargs=call.kwargs, budget_bytes=budget_bytes, compile=True
    )
    optimize_s = time.perf_counter() - started
    assert plan.module is not None and plan.compiled is not None
    return {
        "compile_s": optimize_s - _forward_backward(plan.module, call),
        "planning_s": plan.compiled.planning_s,
        "attempts": plan.compiled.attempts,
        "checkpointed_regions": len(plan.regions),
    }


WORKERS: dict[str, Callable[..., dict[str, Any]]] = {
    "torch.compile": _torch_compile_s,
    "budget": _planned_budget,
    "planned": _planned_compile_s,
}


def _in_fresh_process(kind: str, name: str, *arguments: int) -> dict[str, Any]:
    """Run one worker in a new interpreter with an empty inductor cache (a cold compile)."""
    with tempfile.TemporaryDirectory(prefix="compile-time-") as cache, tempfile.TemporaryDirectory() as out:
        environment = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        }
        result = Path(out) / "result.json"
        command = [
            sys.executable,
            "-m",
            "bench.compile_time",
            "--worker",
            kind,
            name,
            *map(str, arguments),
            "--worker-out",
            str(result),
        ]
        subprocess.run(
            command, check=True, env=environment, timeout=WORKER_TIMEOUT_S, cwd=RESULTS.parent.parent
        )
        return json.loads(result.read_text())


def measure_model(name: str) -> dict[str, Any]:
    print(f"{name}: torch.compile", file=sys.stderr, flush=True)
    baseline = _in_fresh_process("torch.compile", name)
    planned_budget = _in_fresh_process("budget", name)
    if "refused" in planned_budget:
        print(f"{name}: refused: {planned_budget['refused']}", file=sys.stderr, flush=True)
        return {"torch_compile_s": baseline["compile_s"], "refused": planned_budget["refused"]}
    budget = planned_budget["budget_bytes"]
    print(f"{name}: planned at {budget / 2**20:.2f} MiB", file=sys.stderr, flush=True)
    planned = _in_fresh_process("planned", name, budget)
    return {
        "budget_bytes": budget,
        "torch_compile_s": baseline["compile_s"],
        "torch_compile_budget_s": _in_fresh_process("torch.compile", name, PEER_PERCENT)["compile_s"],
        "planned_compile_s": planned["compile_s"],
        "planning_s": planned["planning_s"],
        "attempts": planned["attempts"],
        "checkpointed_regions": planned["checkpointed_regions"],
        "ratio": planned["compile_s"] / baseline["compile_s"],
    }


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """One line per model; each names the load average when it started and the commit it measured."""
    lines = [
        "# Compile time, planned vs torch.compile (cold caches)",
        "",
        f"| model | torch.compile s | torch.compile at budget {PEER_PERCENT / 100:g} s | planned s "
        "| of it planning s | compilations | planned / torch.compile | within 2x | load (1 min) | commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        where = f"{_load_1_min(row)} | {str(row.get('revision') or '—')[:7]} |"
        if "refused" in row:
            lines.append(
                f"| {name} | {row['torch_compile_s']:.1f} | "
                f"| refused: {row['refused'].split(';')[0]} | | | | | {where}"
            )
            continue
        verdict = "yes" if row["ratio"] <= MAX_RATIO else "**no**"
        lines.append(
            f"| {name} | {row['torch_compile_s']:.1f} | {row['torch_compile_budget_s']:.1f} "
            f"| {row['planned_compile_s']:.1f} "
            f"| {row['planning_s']:.1f} | {row['attempts']} | {row['ratio']:.2f} | {verdict} | {where}"
        )
    return "\n".join(lines) + "\n"


def _load_1_min(row: dict[str, Any]) -> str:
    load = row.get("load_average")
    return f"{load[0]:.1f}" if load else "—"


def _kept_results(out: Path) -> dict[str, dict[str, Any]]:
    """The rows an earlier run wrote at `out`, which a run with --models replaces model by model."""
    try:
        return dict(json.loads(out.read_text())["models"])
    except (OSError, ValueError, KeyError):
        return {}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_time.json")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.worker:
        kind, name, *rest = arguments.worker
        # both sides compile the step as one graph (bench/compare_measurement.py, NOTE [log calls])
        with torch._dynamo.config.patch(ignore_logger_methods=log_methods()):
            measured = WORKERS[kind](name, *map(int, rest))
        arguments.worker_out.write_text(json.dumps(measured))
        return 0
    names = arguments.models.split(",") if arguments.models else list(MODELS)
    revision = planner_revision()
    context = {
        "machine": machine(),
        "torch": torch.__version__,
        "command": [Path(sys.executable).name, *sys.argv],
        "revision": revision,
    }
    results = _kept_results(arguments.out) if arguments.models else {}
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        # Each row names its commit and load: a run with --models keeps the other models' rows.
        load = machine()["load_average_1_5_15_min"]
        results[name] = {**measure_model(name), "revision": revision["commit"], "load_average": load}
        # Written after every model, so an interrupted run keeps what it measured.
        arguments.out.write_text(json.dumps({**context, "models": results}, indent=1) + "\n")
    table = markdown(results)
    arguments.out.with_suffix(".md").write_text(table)
    refresh_quotes(arguments.out.with_suffix(".md"))
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
