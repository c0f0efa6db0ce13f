"""`make gpu-check`: the device-memory predictions against a real CUDA allocator, in one short run.

Why it exists: every byte figure the planner promises for a GPU (512-byte blocks, the caching allocator's
reserved memory, what a card holds back for the CUDA context and cuBLAS) is modelled on a CPU, where CI
and development run. The day a GPU is lent, this measures all of them at once (80 seconds of script on
one H100, nothing downloaded) and writes `bench/results/gpu_check.json`:

1. `device`: the card, and what it holds back, measured: the CUDA context (the card's used memory
   beyond what the allocator reserved, from `torch.cuda.mem_get_info` right after initialisation) and
   the cuBLAS workspaces a training step's two threads allocate (`memory_allocated` before and after).
   These replace the allowances of NOTE [held back] in planner/profiler/cost_model.py.
2. `rows`: every zoo model and the Hugging Face models of planner/testing/zoo_real.py, planned on the
   GPU at three budgets (the lowest allocated peak, halfway, no checkpointing) under the default
   allocator and under `expandable_segments:True`; per row the predicted allocated peak (512-byte blocks)
   and reserved peak (simulation/reserved.py) against `max_memory_allocated` and `max_memory_reserved` of
   two real steps of `plan.module`, less what other tensors held on the device when they began (the
   cuBLAS workspaces of part 1 among them: the prediction leaves them out; NOTE [other tensors on the
   device] in planner/profiler/measurement.py), and where the prediction puts its peak (each phase's,
   the node, the bytes by component) beside the measured phases; `workspaces` lists each model's
   forward workspaces as profiled on the card, the first suspect where a prediction runs above its
   measurement (Hugging Face models by 10 to 27 KB on an H100). Under the default allocator each plan
   also trains one step beside the model (same seed, dropout included): `step_mismatch` says what
   differed, or is null.
   The kernels a GPU picks, and so their dropout draws, follow how each operator is called, so a
   captured module can train otherwise on a GPU than on the CPU (NOTE [grouped heads] in
   planner/capture/attention_masks.py: zoo_real's Llama did, found by bench.compare on an H100).
3. `node_times`: per-node forward times measured on the GPU against the analytic roofline of the card
   (planner/profiler/cost_model.py), as the median and spread of their ratio.

On a lent GPU machine, whose `python3` holds a CUDA build of torch, `make gpu-check` runs this with that
interpreter and the repository on PYTHONPATH. Without CUDA (CI), part 2 runs on the CPU, where measured
peaks are counted by the live-storage tracker in 512-byte blocks and reserved memory is only predicted,
and the JSON says the CUDA parts were skipped.

    .venv/bin/python -m bench.gpu_check                       # what `make gpu-check` runs
    .venv/bin/python -m bench.gpu_check --quick --out /tmp/gpu_check.json   # two models, one budget
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import planner
from bench.peers import GRADIENT_RTOL
from planner.ir import ActivationGraph, BudgetKind
from planner.profiler.cost_model import DEVICES, cublas_workspace_bytes, device_spec
from planner.simulation.reserved import predict_reserved
from planner.testing.steps import buffer_mismatch, gradient_mismatch, one_step
from planner.zoo import FIDELITY_ZOO, build_model

log = logging.getLogger("bench.gpu_check")

DEFAULT_OUT = Path("bench/results/gpu_check.json")
FRACTIONS = (0.0, 0.5, 1.0)
"""Budgets between the lowest allocated peak (0) and no checkpointing (1)."""
ALLOCATOR_CONFS = ("", "expandable_segments:True")
HF_MODELS = ("hf_gpt2", "hf_bert", "hf_llama", "hf_t5", "hf_vit")
QUICK_MODELS = ("seed000_mlp", "gpt_tiny")
TIMED_MODELS = ("gpt_tiny", "seed003_feedforward")
SOLVER = "dp"
"""The exact dynamic program: it needs no OR-tools, which a lent GPU machine's Python may lack."""


@dataclasses.dataclass(frozen=True)
class Call:
    """A model and its example call, on the device the check runs on."""

    name: str
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_to(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to(item, device) for key, item in value.items()}
    return value


def calls_on(names: tuple[str, ...], device: torch.device) -> Iterator[Call]:
    """Each named zoo, real-zoo or sized-zoo model and its example call, moved to `device` (an entry
    whose library is not installed is skipped, with a warning)."""
    from planner.testing.zoo_real import REAL_ZOO, build_call
    from planner.testing.zoo_sized import SIZED_ZOO

    for name in names:
        if name in REAL_ZOO or name in SIZED_ZOO:
            try:
                call = SIZED_ZOO[name].build() if name in SIZED_ZOO else build_call(name)
            except ImportError as error:  # transformers, timm: dev extras or not installable here
                log.warning("%s skipped: %s", name, error)
                continue
            yield Call(name, call.model.to(device), _to(call.args, device), _to(call.kwargs, device))
        else:
            model, inputs = build_model(name)
            yield Call(name, model.to(device), _to(inputs, device), {})


@contextmanager
def _allocator(conf: str, device: torch.device) -> Iterator[None]:
    """The caching allocator configured by `conf` for what runs inside, with its cache emptied."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.memory._set_allocator_settings(conf or "expandable_segments:False")
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        torch.cuda.empty_cache()


def _measured(plan: planner.Plan, call: Call, device: torch.device) -> dict[str, Any]:
    """Two real steps of `plan.module` itself: allocated (blocks), exact and reserved peaks.

    Not a copy: a copy would leave the model's own parameters on the device beside it, in segments the
    reserved peak cannot tell apart (NOTE [other tensors on the device] in profiler/measurement.py).
    The steps train the model; its later plans only need its structure."""
    assert plan.module is not None
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    step = planner.measure(plan.module, call.args, example_kwargs=call.kwargs or None)
    plan.module.zero_grad(set_to_none=True)
    return {
        "allocated_bytes": step.peak_bytes,
        "exact_bytes": step.exact_peak_bytes,
        "reserved_bytes": step.reserved_peak_bytes,
        "others_bytes": step.others_bytes,
        "phase_bytes": step.phase_peak_bytes,
    }


def _predicted_shape(plan: planner.Plan) -> dict[str, Any]:
    """Where the prediction puts the peak, to set beside the measured phases: each phase's peak, the
    node at the overall peak, and the bytes there by component."""
    phases: dict[str, int] = {}
    for step in plan.simulation.trace:
        phases[step.phase.value] = max(phases.get(step.phase.value, 0), step.live_bytes)
    return {
        "predicted_phase_bytes": phases,
        "predicted_peak_node": plan.simulation.peak_node,
        "predicted_breakdown": {
            str(component): size for component, size in plan.simulation.breakdown.items()
        },
    }


def _forward_workspaces(graph: ActivationGraph) -> dict[str, int]:
    """Each node's forward workspace as profiled: on CUDA, what the allocator rose beyond the storages
    the tracker saw (NOTE [library workspaces] in planner/profiler/records.py), the first suspect where
    a GPU prediction runs above its measurement."""
    return {node.name: node.forward_workspace_bytes for node in graph.nodes if node.forward_workspace_bytes}


def _step_mismatch(plan: planner.Plan, call: Call) -> str | None:
    """What differs between one step of `plan.module` and one of the model (copies of both, same seed),
    or None: loss and gradients to `GRADIENT_RTOL` of their scale, buffers bitwise."""
    assert plan.module is not None
    kwargs = call.kwargs or None
    expected = one_step(call.model, call.args, kwargs=kwargs)
    actual = one_step(plan.module, call.args, kwargs=kwargs)
    return gradient_mismatch(expected, actual, rtol=GRADIENT_RTOL) or buffer_mismatch(expected, actual)


@contextmanager
def _recorded(path: Path | None, device: torch.device) -> Iterator[None]:
    """With `path` on CUDA: the allocator's history of what runs inside, written as a memory snapshot
    (pytorch.org/memory_viz reads it) to calibrate the reserved-memory model against."""
    if path is None or device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        yield
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _rows(
    call: Call, device: torch.device, fractions: tuple[float, ...], snapshots: Path | None = None
) -> tuple[list[dict], dict[str, int]]:
    """One row per allocator setting and budget for `call` (see the module docstring, part 2); with
    `snapshots`, the default allocator's middle budget leaves `<model>_measured.pickle` (the measured
    steps' allocator history) and `<model>_plan.json` (the plan, its graph included) there."""
    profiled = planner.profile(call.model, call.args, example_kwargs=call.kwargs or None)
    reference = profiled.plan(budget_bytes=2**62, budget_kind=BudgetKind.ALLOCATED, solver=SOLVER)
    rows = []
    for conf in ALLOCATOR_CONFS:
        with _allocator(conf, device):
            for fraction in fractions:
                span = reference.baseline_peak_bytes - reference.min_peak_bytes
                budget = int(reference.min_peak_bytes + fraction * span)
                plan = profiled.plan(budget_bytes=budget, budget_kind=BudgetKind.ALLOCATED, solver=SOLVER)
                reserved = predict_reserved(plan.graph, plan.schedule)
                predicted_reserved = (
                    reserved.expandable_reserved_peak_bytes if conf else reserved.reserved_peak_bytes
                )
                recorded = snapshots is not None and not conf and fraction == fractions[len(fractions) // 2]
                if recorded:
                    assert snapshots is not None
                    (snapshots / f"{call.name}_plan.json").write_text(plan.to_json())
                snapshot = snapshots / f"{call.name}_measured.pickle" if recorded and snapshots else None
                step_mismatch = None if conf else _step_mismatch(plan, call)
                with _recorded(snapshot, device):
                    measured = _measured(plan, call, device)
                allocated = measured["allocated_bytes"]
                row = {
                    "model": call.name,
                    "allocator": conf or "default",
                    "fraction": fraction,
                    "budget_bytes": budget,
                    "predicted_allocated_bytes": plan.predicted_peak_bytes,
                    "predicted_allocator_allocated_bytes": reserved.allocated_peak_bytes,
                    "predicted_reserved_bytes": predicted_reserved,
                    "measured": measured,
                    "allocated_error": (plan.predicted_peak_bytes - allocated) / allocated,
                    **_predicted_shape(plan),
                    "fits": allocated <= budget,
                }
                if not conf:
                    row["step_mismatch"] = step_mismatch
                if measured["reserved_bytes"] is not None:
                    row["reserved_error"] = (predicted_reserved - measured["reserved_bytes"]) / measured[
                        "reserved_bytes"
                    ]
                rows.append(row)
                otherwise = f"; trains otherwise: {step_mismatch}" if step_mismatch else ""
                log.info(
                    "%s %s f=%.1f: predicted %d, measured %d (%+.2f %%)%s",
                    call.name, conf or "default", fraction, plan.predicted_peak_bytes, allocated,
                    100 * row["allocated_error"], otherwise,
                )  # fmt: skip
    return rows, _forward_workspaces(profiled.graph)


def _device_facts(device: torch.device) -> dict[str, Any]:
    """Part 1: the card and what it holds back, measured."""
    if device.type != "cuda":
        return {"type": device.type, "cuda": "skipped: no CUDA device on this machine"}
    properties = torch.cuda.get_device_properties(device)
    torch.cuda.init()
    torch.empty(1, device=device)
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    context_bytes = total_bytes - free_bytes - torch.cuda.memory_reserved(device)
    before = torch.cuda.memory_allocated(device)
    weight = torch.randn(256, 256, device=device, requires_grad=True)
    (weight @ weight).sum().backward()  # the forward thread's handle, then autograd's device thread's
    torch.cuda.synchronize(device)
    workspace_bytes = torch.cuda.memory_allocated(device) - before - 2 * weight.untyped_storage().nbytes()
    major = properties.major
    return {
        "type": "cuda",
        "name": properties.name,
        "compute_capability": f"{properties.major}.{properties.minor}",
        "total_bytes": total_bytes,
        "measured_context_bytes": context_bytes,
        "measured_cublas_workspace_bytes": workspace_bytes,
        "allowance_context_bytes": DEVICES["h100"].context_bytes,
        "allowance_cublas_workspace_bytes": 2 * cublas_workspace_bytes(major),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def _node_times(device: torch.device, names: tuple[str, ...]) -> dict[str, Any]:
    """Part 3: measured per-node forward times against the card's roofline."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device on this machine"}
    spec = device_spec("h100" if torch.cuda.get_device_capability(device)[0] >= 9 else "a100")
    report: dict[str, Any] = {"analytic_device": spec.name}
    for call in calls_on(names, device):
        measured = planner.profile(call.model, call.args, example_kwargs=call.kwargs or None).graph
        analytic = planner.profile(
            call.model, call.args, example_kwargs=call.kwargs or None, cost_model="analytic", device=spec
        ).graph
        pairs = [
            (m, a)
            for m, a in zip(measured.nodes, analytic.nodes, strict=False)
            if m.name == a.name and a.forward_ms > 0 and m.forward_ms > 0
        ]
        ratios = [m.forward_ms / a.forward_ms for m, a in pairs]
        report[call.name] = {
            "nodes": len(ratios),
            "median_measured_over_analytic": statistics.median(ratios) if ratios else None,
            "min": min(ratios, default=None),
            "max": max(ratios, default=None),
            "measured_step_overheads_ms": {
                "checkpoint_call_ms": measured.checkpoint_call_ms,
                "checkpoint_op_ms": measured.checkpoint_op_ms,
            },
            "per_node": [  # to fit the roofline's floor (a kernel launch) to the card
                {
                    "name": m.name,
                    "op": m.op,
                    "measured_forward_ms": m.forward_ms,
                    "measured_backward_ms": m.backward_ms,
                    "analytic_forward_ms": a.forward_ms,
                    "analytic_backward_ms": a.backward_ms,
                }
                for m, a in pairs
            ],
        }
    return report


def _failure(name: str, part: str, error: BaseException) -> dict[str, str]:
    """What went wrong with one model, kept in the JSON instead of ending the run."""
    log.exception("%s failed in %s", name, part)
    last = traceback.extract_tb(error.__traceback__)[-1]
    return {
        "model": name,
        "part": part,
        "error": f"{type(error).__name__}: {error}",
        "at": f"{last.filename}:{last.lineno}",
    }


def _summary(rows: list[dict], started: float) -> dict[str, Any]:
    errors = [abs(row["allocated_error"]) for row in rows]
    stepped = [row for row in rows if "step_mismatch" in row]
    return {
        "rows": len(rows),
        "fit": sum(row["fits"] for row in rows),
        "stepped": len(stepped),
        "trained_as_the_model": sum(row["step_mismatch"] is None for row in stepped),
        "worst_allocated_error": max(errors, default=None),
        "worst_reserved_error": max(
            (abs(row["reserved_error"]) for row in rows if "reserved_error" in row), default=None
        ),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_MODELS)}, one budget")
    parser.add_argument("--models", help="comma-separated zoo, zoo_real or zoo_sized names (default: all)")
    parser.add_argument(
        "--fractions",
        help=f"comma-separated budgets between the lowest peak (0) and none (1) (default: {FRACTIONS})",
    )
    parser.add_argument(
        "--snapshots",
        type=Path,
        help="write each model's measured allocator history and plan here (CUDA; one model per run: "
        "recording a second crashed autograd under torch 2.11)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=420.0,
        help="start no new model after this many seconds (default 420)",
    )
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    facts = _device_facts(device)
    if arguments.models:
        names = tuple(arguments.models.split(","))
    elif arguments.quick:
        names = QUICK_MODELS
    else:
        names = (*FIDELITY_ZOO, *HF_MODELS)
    if arguments.fractions:
        fractions = tuple(float(fraction) for fraction in arguments.fractions.split(","))
    else:
        fractions = (0.5,) if arguments.quick else FRACTIONS
    document: dict[str, Any] = {
        "device": facts,
        "ran_on": str(device),
        "rows": [],
        "workspaces": {},
        "failures": [],
        "not_run": [],
    }
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    if arguments.snapshots is not None:
        arguments.snapshots.mkdir(parents=True, exist_ok=True)
    for name in names:
        if time.perf_counter() - started > arguments.deadline_s:
            document["not_run"].append(name)
            continue
        try:
            for call in calls_on((name,), device):
                rows, workspaces = _rows(call, device, fractions, arguments.snapshots)
                document["rows"].extend(rows)
                document["workspaces"][call.name] = workspaces
        except Exception as error:  # noqa: BLE001 - one model's failure is a finding, not the end of the run
            document["failures"].append(_failure(name, "rows", error))
        document["summary"] = _summary(document["rows"], started)
        arguments.out.write_text(json.dumps(document, indent=1))  # what ran so far survives a later crash
    try:
        document["node_times"] = _node_times(device, () if arguments.quick else TIMED_MODELS)
    except Exception as error:  # noqa: BLE001
        document["failures"].append(_failure("node_times", "node_times", error))
    document["summary"] = _summary(document["rows"], started)
    arguments.out.write_text(json.dumps(document, indent=1))
    print(json.dumps(document["summary"]))
    print(f"wrote {arguments.out}", file=sys.stderr)
    summary = document["summary"]
    return 1 if document["failures"] or summary["trained_as_the_model"] < summary["stepped"] else 0


if __name__ == "__main__":
    sys.exit(main())
