"""Where a compiled training step spends its time: each kernel's self time, torch.compile's and ours.

Why it exists: bench/compare.py says whether our compiled plan is slower than a compile-budget peer at
the peer's measured peak; this says where the time goes. For one model and one fraction it builds four
compiled variants as compare.py does (no checkpointing, `activation_memory_budget=fraction`, and our
`dp` and `ilp` plans with the peer's measured peak as their budget), has inductor record each generated
C++ kernel in the profiler (`cpp.enable_kernel_profile`), and profiles forward-and-backward steps of
the variants in alternating blocks, so that drift in the machine's speed hits each alike (NOTE [timing
noise] in bench/peers.py). A kernel's name starts with its graph's number, which differs between
variants; it is dropped, so the same fused kernel lines up across variants.

    .venv/bin/python -m bench.kernel_time --model seed002_cifar10 --fraction 0.5
    .venv/bin/python -m bench.kernel_time --model hf_llama --fraction 0.5 --blocks 16

Results: JSON at `--out` (default bench/results/kernel_time_<model>_<fraction>.json) with every
kernel's milliseconds per step in each variant, and a markdown table beside it of the kernels whose
time differs most between our `ilp` plan and the peer. Self times are the profiler's (measured, one
torch thread), not predictions.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import compare, compare_plans
from bench.compare_measurement import compiler_settings, measure_candidate
from bench.peers import machine, planner_revision
from planner.profiler.measurement import default_loss
from planner.testing.steps import variant_of

RESULTS = Path(__file__).resolve().parent / "results"
GRAPH_PREFIX = re.compile(r"^graph_\d+_")
COMPILED_REGION = re.compile(r"^(Torch-Compiled Region): \d+/\d+$")
TOP_KERNELS = 20
SOLVERS = ("dp", "ilp")


def kernel_key(name: str) -> str:
    """A profiler event's name without what differs between compilations of the same step: inductor's
    graph number before a kernel (`graph_3_cpp_fused_relu_1`), dynamo's frame and compile ids."""
    return COMPILED_REGION.sub(r"\1", GRAPH_PREFIX.sub("", name))


def variants(call: compare.ExampleCall, fraction: float) -> tuple[dict[str, torch.nn.Module], dict[str, Any]]:
    """No checkpointing, the peer at `fraction`, and our plans at the peer's measured peak; and each
    one's measured peak in bytes."""
    reference = compare.one_step(variant_of(call.model), call.args, kwargs=call.kwargs)
    none = compare.fraction_candidate(call, 1.0)
    baseline = measure_candidate(none, call, reference)
    peer = compare.fraction_candidate(call, fraction)
    measure_candidate(peer, call, baseline)
    candidates = {"no checkpointing": none, f"compile budget {fraction:g}": peer}
    plans = compare_plans.CompiledPlans(call)
    for solver in SOLVERS:
        row = compare_plans.our_row(peer.row, solver)
        ours = compare_plans.our_candidate(plans, row)
        if ours is None:
            raise SystemExit(f"our {solver} plan at the peer's peak failed: {row.error}")
        measure_candidate(ours, call, baseline)
        candidates[f"ours {solver}"] = ours
    modules = {name: candidate.variant.module for name, candidate in candidates.items()}
    peaks = {name: candidate.row.peak_bytes for name, candidate in candidates.items()}
    return modules, peaks


def profiled_ms(
    modules: Mapping[str, torch.nn.Module], call: compare.ExampleCall, *, blocks: int, steps: int
) -> dict[str, dict[str, float]]:
    """Milliseconds per step of each profiler event's self time, per variant: `blocks` rounds of
    `steps` steps each, the variants' order reversed every other round."""
    totals_us = {name: Counter[str]() for name in modules}
    names = list(modules)
    for name in names:  # warm-up: the first steps allocate and fault pages in
        _steps(modules[name], call, 2)
    for block in range(blocks):
        for name in names if block % 2 == 0 else reversed(names):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                _steps(modules[name], call, steps)
            for event in profiler.key_averages():
                totals_us[name][kernel_key(event.key)] += event.self_cpu_time_total
    measured_steps = blocks * steps
    return {
        name: {key: us / 1e3 / measured_steps for key, us in totals.most_common()}
        for name, totals in totals_us.items()
    }


def _steps(module: torch.nn.Module, call: compare.ExampleCall, count: int) -> None:
    for _ in range(count):
        default_loss(module(*call.args, **call.kwargs)).backward()


def markdown(result: Mapping[str, Any]) -> str:
    """Totals per variant, then the kernels whose time differs most between ours (ilp) and the peer."""
    kernels: dict[str, dict[str, float]] = result["kernel_ms"]
    names = list(kernels)
    peer, ours = names[1], names[-1]
    lines = [
        f"# Kernel self time per step: {result['model']}, compile budget {result['fraction']:g}",
        "",
        f"{result['machine']}; one torch thread; {result['blocks']} alternating blocks of {result['steps']} "
        f"steps per variant; planner {result['planner_revision']}. Command: `{result['command']}`",
        "",
        "| variant | measured peak (MiB) | self time, all events (ms per step) |",
        "|---|---|---|",
    ]
    for name in names:
        peak = result["peak_bytes"][name]
        lines.append(f"| {name} | {peak / 2**20:.2f} | {sum(kernels[name].values()):.2f} |")
    keys = set().union(*(set(times) for times in kernels.values()))
    differing = sorted(keys, key=lambda key: -abs(kernels[ours].get(key, 0.0) - kernels[peer].get(key, 0.0)))
    lines += ["", f"Kernels whose time differs most between {ours} and {peer} (ms per step):", ""]
    lines += ["| kernel | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in differing[:TOP_KERNELS]:
        cells = " | ".join(f"{kernels[name].get(key, 0.0):.3f}" for name in names)
        lines.append(f"| `{key}` | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=compare.MODELS)
    parser.add_argument("--fraction", type=float, default=0.5, help="the peer's activation_memory_budget")
    parser.add_argument("--blocks", type=int, default=8, help="alternating profiled blocks per variant")
    parser.add_argument("--steps", type=int, default=5, help="steps per profiled block")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not 0.0 <= args.fraction < 1.0:
        parser.error(f"--fraction must be in [0, 1) (a peer that recomputes), got {args.fraction}")
    if args.blocks < 1 or args.steps < 1:
        parser.error(f"--blocks and --steps must be at least 1, got {args.blocks} and {args.steps}")
    out = args.out or RESULTS / f"kernel_time_{args.model}_{args.fraction:g}.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with compiler_settings(), torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
            call = compare.build_example(args.model, "cpu")
            modules, peaks = variants(call, args.fraction)
            kernel_ms = profiled_ms(modules, call, blocks=args.blocks, steps=args.steps)
    finally:
        torch.set_num_threads(threads)
    result = {
        "model": args.model,
        "fraction": args.fraction,
        "blocks": args.blocks,
        "steps": args.steps,
        "machine": machine(),
        "planner_revision": planner_revision(),
        "command": "python -m bench.kernel_time " + " ".join(sys.argv[1:] if argv is None else argv),
        "peak_bytes": peaks,
        "kernel_ms": kernel_ms,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    sys.stdout.write(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
