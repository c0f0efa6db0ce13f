"""Side-by-side benchmark: our plans against the checkpointing users pick today, measured in one run.

Why it exists: the planner claims "fits the budget, with the least recompute". That claim holds only if
it is measured beside what users would otherwise do, on the same machine, in the same run. Per model
(GPT-2-, BERT- and Llama-style transformers, a ViT, ResNet-, DenseNet- and U-Net-style CNNs and a
diffusers UNet2DModel from `planner.testing.zoo_real`, and the seed models of
`planner.zoo.FIDELITY_ZOO`), each in a process of its own so that compiled code and memory do not leak
from one model into the next, it measures these rows:

eager
    no checkpointing; "sqrt(n) segments" (`checkpoint_sequential`), and the model's "own switch" where
    its library has one (Hugging Face's `gradient_checkpointing_enable`, timm's
    `set_grad_checkpointing`, diffusers' `enable_gradient_checkpointing`), else "every block"
    (`checkpoint_wrapper` on each block): the hand methods of planner/testing/hand_methods.py; our `dp`
    and `ilp` plans with each peer's measured peak as the budget.
compiled (`torch.compile`, inductor)
    `torch._functorch.config.activation_memory_budget` at several fractions (1.0 is compiled no
    checkpointing); our `dp` and `ilp` plans of the compiled step (`planner.optimize(..., compile=True)`,
    planner/compiled/optimize.py) with each fraction's measured peak as the budget. Both sides are
    compiled, so compile speed-ups bias neither.

For every row: the measured peak of two Adam training steps, whether it respected the budget it was
given, the step-time ratio against no checkpointing of the same mode (median over interleaved rounds,
bench/peers.py), and whether loss, gradients and buffers after one step under one seed (dropout
included) equal the unmodified model's: the eager model's for eager rows, compiled no checkpointing's
for compiled rows (NOTE [compiled gradients]). How a row's variant is compiled and measured is
bench/compare_measurement.py's, with the notes on measuring compiled steps, their gradients, the compile
caches and log calls.

Budgets: ours is given a byte budget (the peer's peak) and respects it when its measured peak is at most
that. A fraction of `activation_memory_budget` bounds the activations the compiled forward keeps for
backward, relative to the default partition; it is respected when the bytes still live after the
forward are at most that fraction of compiled no-checkpointing's (plus `KEPT_SLACK`). sqrt(n) segments
and every block take no budget.

How our rows are planned at each peer's peak, eager and compiled, is bench/compare_plans.py's, with
NOTE [compiled budgets].

Run from the repository root (two models at a time by default, `--jobs`; see `DEFAULT_JOBS`):

    .venv/bin/python -m bench.compare --quick      # 2 small models, 3 rounds, fractions 1.0 and 0.0
    .venv/bin/python -m bench.compare              # the whole zoo, 15+ rounds, fractions 1.0/0.5/0.2/0.0
    .venv/bin/python -m bench.compare --models gpt_tiny,hf_gpt2 --out /tmp/compare.json
    .venv/bin/python -m bench.compare --device cuda    # its own files: compare_cuda.{json,md,png}
    .venv/bin/python -m bench.compare --render bench/results/compare.json    # tables and plot again
    .venv/bin/python -m bench.compare --compiled-only --out /tmp/compiled.json  # compiled rows alone
    .venv/bin/python -m bench.compare --eager-only --out /tmp/eager.json  # eager rows alone
    .venv/bin/python -m bench.compare --eager-only --models sized_qwen2,sized_mixtral   # issue 35's sizes

Results: JSON at `--out` (default `bench/results/compare.json`, `compare_quick.json` with `--quick`), the
markdown tables (`.md`, also printed to stdout; verdicts and rendering live in bench/compare_report.py) and
the plot (`.png`: measured peak against step-time ratio, per model) beside it; writing the default results
(or `--render` of them) also rewrites the summary table docs/benchmark.md quotes (bench/docs_tables.py).
Models run longest first by the previous JSON's timings. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import planner
from bench.compare_measurement import (
    Candidate,
    allocator_step_memory,
    compiled,
    compiler_settings,
    measure_candidate,
)
from bench.compare_plans import (
    REFERENCE_BUDGET_BYTES,
    CompiledPlans,
    OurPlans,
    PredictedRange,
    error_text,
    optimize_at,
    our_candidates,
)
from bench.compare_plot import plot
from bench.compare_report import (
    NO_CHECKPOINTING,
    Family,
    Mode,
    ModelResult,
    Row,
    TrackerCheck,
    label,
    markdown,
    result_from_dict,
)
from bench.docs_tables import refresh_quotes
from bench.peers import (
    Contender,
    contender,
    interleaved_step_ms,
    machine,
    paired_ratio,
    planner_revision,
)
from planner import zoo
from planner.testing.hand_methods import HandMethod, every_block, own_switch, sqrt_segments
from planner.testing.steps import (
    StepRecord,
    copied_variant,
    one_step,
    variant_of,
    with_run_to_run_noise,
)
from planner.testing.zoo_real import ExampleCall, build_call
from planner.testing.zoo_sized import SIZED_ZOO

log = logging.getLogger("bench.compare")

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
REPOSITORY = Path(__file__).resolve().parent.parent
"""Where the workers run `python -m bench.compare`."""
REAL_MODELS = ("hf_gpt2", "hf_bert", "hf_llama", "hf_vit", "resnet", "densenet", "unet", "diffusers_unet")
MODELS = (*zoo.FIDELITY_ZOO, *REAL_MODELS)
QUICK_MODELS = ("seed000_mlp", "seed002_cifar10")
FRACTIONS = (1.0, 0.5, 0.2, 0.0)
QUICK_FRACTIONS = (1.0, 0.0)
NO_CHECKPOINTING_FRACTION = 1.0
"""activation_memory_budget=1.0 is the default partition: compiled no checkpointing."""
TIMING_ROUNDS = 15
"""Timing rounds at least, per model and mode (NOTE [timing noise] in bench/peers.py)."""
TIMING_S = 60.0
"""Seconds of timing per model and mode: a model whose rounds are quick gets more of them."""
MAX_TIMING_ROUNDS = 201
QUICK_TIMING_ROUNDS = 3
WARMUP_STEPS = 1
"""Untimed steps per variant first: one creates Adam's state; compiled variants already ran while measured."""
KEPT_SLACK = 0.02
"""Allowance, as a fraction of compiled no-checkpointing's kept bytes, before a fraction counts as missed."""
MODEL_TIMEOUT_S = 2400
"""A model that compiles many plans (DenseNet, gpt_tiny: up to seven compilations of 1-2 min each on a
loaded 2-core machine) takes 20 min or more; the limit only catches a hung worker."""
DEFAULT_JOBS = 2
"""Two models at a time, each with half the cores: most of a model's time is compiling and profiling,
which use one core, so two processes finish the zoo in about half the time. Each process times its own
variants in interleaved rounds, so the other process slows all of them alike."""


@dataclass(frozen=True)
class Settings:
    device: str
    fractions: tuple[float, ...]
    rounds: int
    """Timing rounds at least; as many more as fit `timing_s` (at most `MAX_TIMING_ROUNDS`)."""
    timing_s: float
    quick: bool
    jobs: int
    """Models benchmarked at once, each in its own process with cpu_count / jobs torch threads."""
    compiled_only: bool = False
    """Measure the compiled rows alone (no eager peers and plans)."""
    eager_only: bool = False
    """Measure the eager rows alone (no compiled peers and plans)."""


def build_example(name: str, device: str) -> ExampleCall:
    """A zoo or real-zoo model and its example call, on `device`."""
    if name in zoo.ZOO:
        model, inputs = zoo.build_model(name)
        call = ExampleCall(model, inputs)
    elif name in SIZED_ZOO:
        call = SIZED_ZOO[name].build()
    else:
        call = build_call(name)
    return ExampleCall(
        call.model.to(device),
        tuple(value.to(device) if isinstance(value, torch.Tensor) else value for value in call.args),
        {
            key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in call.kwargs.items()
        },
    )


def copy_measurements(candidate: Candidate, first: Candidate) -> None:
    """Give a row whose variant another row already measured that row's measurements (its own budget)."""
    measured = (
        "peak_bytes", "kept_after_forward_bytes", "gradients_equal", "gradient_error", "gradient_mismatch",
        "buffers_equal", "ran_compiled", "error",
    )  # fmt: skip
    for name in measured:
        setattr(candidate.row, name, getattr(first.row, name))
    candidate.row.same_plan_as = label(first.row)
    if candidate.row.budget_bytes is not None and candidate.row.peak_bytes is not None:
        candidate.row.within_budget = candidate.row.peak_bytes <= candidate.row.budget_bytes


def measure_all(
    candidates: Sequence[Candidate],
    call: ExampleCall,
    reference: StepRecord,
    *,
    measured: Sequence[Candidate] = (),
) -> None:
    """Measure each distinct variant once; rows sharing a variant (also with `measured` ones) copy it."""
    first_of = {id(candidate.variant): candidate for candidate in measured}
    for candidate in candidates:
        first = first_of.setdefault(id(candidate.variant), candidate)
        if first is not candidate:
            copy_measurements(candidate, first)
            continue
        try:
            measure_candidate(candidate, call, reference)
        except Exception as error:  # a variant that breaks on a model is a finding, not the end of the run
            log.exception("  %s %s failed", candidate.row.mode, label(candidate.row))
            candidate.row.error = error_text(error)


def measured_ones(candidates: Sequence[Candidate]) -> list[Candidate]:
    return [candidate for candidate in candidates if candidate.row.error is None]


def time_candidates(candidates: Sequence[Candidate], call: ExampleCall, settings: Settings) -> None:
    """Interleaved training steps of every distinct variant; ratios against the mode's baseline."""
    runners: dict[int, Contender] = {}
    for candidate in candidates:
        if id(candidate.variant) not in runners:
            runners[id(candidate.variant)] = contender(
                label(candidate.row),
                candidate.variant.module,
                call.args,
                kwargs=call.kwargs,
                copy_module=candidate.row.mode is Mode.EAGER,
            )
    rounds = interleaved_step_ms(
        list(runners.values()),
        rounds=settings.rounds,
        warmup_steps=WARMUP_STEPS,
        timing_s=settings.timing_s,
        max_rounds=MAX_TIMING_ROUNDS,
    )
    log.info("  timed %d %s variants, %d rounds", len(runners), candidates[0].row.mode, rounds)
    baseline = runners[id(candidates[0].variant)]
    for candidate in candidates:
        runner = runners[id(candidate.variant)]
        candidate.row.step_ms = statistics.median(runner.step_ms)
        candidate.row.time_ratio_vs_none = paired_ratio(runner, baseline)
        candidate.row.round_ratios_vs_none = [
            step_ms / baseline_ms
            for step_ms, baseline_ms in zip(runner.step_ms, baseline.step_ms, strict=True)
        ]


def peer_candidate(method: HandMethod, mode: Mode) -> Candidate | Row:
    """A peer to measure, or its row saying why it does not apply to this model."""
    if method.variant is None:
        return Row(method=method.name, mode=mode, family=Family.PEER, not_applicable=method.description)
    row = Row(method=method.name, mode=mode, family=Family.PEER, description=method.description)
    return Candidate(row, method.variant)


def block_peer(call: ExampleCall) -> HandMethod:
    """The model's own switch where its library has one (what its users reach for), else
    `checkpoint_wrapper` on every block."""
    switch = own_switch(call.model)
    return switch if switch.variant is not None else every_block(call.model)


def eager_rows(
    call: ExampleCall, reference: StepRecord, predicted: PredictedRange, settings: Settings
) -> list[Row]:
    """No checkpointing, the two hand-written peers, and our plans at the peers' measured peaks."""
    log.info(" eager rows")
    none = Candidate(
        Row(method=NO_CHECKPOINTING, mode=Mode.EAGER, family=Family.BASELINE), variant_of(call.model)
    )
    built = [
        peer_candidate(sqrt_segments(call.model, call.args, kwargs=call.kwargs), Mode.EAGER),
        peer_candidate(block_peer(call), Mode.EAGER),
    ]
    peers = [peer for peer in built if isinstance(peer, Candidate)]
    measure_candidate(none, call, reference)
    measure_all(peers, call, reference)
    ours, failed = our_candidates(OurPlans(call, none, predicted), measured_ones(peers))
    measure_all(ours, call, reference, measured=[none, *peers])
    time_candidates(measured_ones([none, *peers, *ours]), call, settings)
    not_applicable = [peer for peer in built if isinstance(peer, Row)]
    return [candidate.row for candidate in (none, *peers, *ours)] + not_applicable + failed


def fraction_candidate(call: ExampleCall, fraction: float) -> Candidate:
    baseline = fraction == NO_CHECKPOINTING_FRACTION
    row = Row(
        method=NO_CHECKPOINTING if baseline else f"compile budget {fraction:g}",
        mode=Mode.COMPILED,
        family=Family.BASELINE if baseline else Family.PEER,
        description=f"torch.compile, activation_memory_budget={fraction:g}",
        budget_fraction=fraction,
    )
    return Candidate(row, compiled(copied_variant(variant_of(call.model)), fraction))


def respects_fraction(row: Row, baseline: Row) -> bool | None:
    """Whether a compiled fraction kept at most its share of no-checkpointing's bytes after forward."""
    if row.budget_fraction is None or row.kept_after_forward_bytes is None:
        return None
    if baseline.kept_after_forward_bytes is None:
        return None
    allowed_bytes = (row.budget_fraction + KEPT_SLACK) * baseline.kept_after_forward_bytes
    return row.kept_after_forward_bytes <= allowed_bytes


def compiled_rows(call: ExampleCall, reference: StepRecord, settings: Settings) -> list[Row]:
    """torch.compile at each activation_memory_budget, and our plans of the compiled step at the
    fractions' peaks."""
    log.info(" compiled rows")
    none, *peers = [fraction_candidate(call, fraction) for fraction in settings.fractions]
    compiled_reference = measure_candidate(none, call, reference)
    measure_all(peers, call, compiled_reference)
    for peer in peers:
        peer.row.within_budget = respects_fraction(peer.row, none.row)
    ours, failed = our_candidates(CompiledPlans(call), measured_ones(peers))
    measure_all(ours, call, compiled_reference, measured=[none, *peers])
    time_candidates(measured_ones([none, *peers, *ours]), call, settings)
    return [candidate.row for candidate in (none, *peers, *ours)] + failed


def tracker_check(call: ExampleCall, compiled_none: Row | None) -> TrackerCheck:
    """The tracker against the allocator on the eager step, and what the tracker makes of a compiled one.

    Runs last: a compiled frame called under the tracker's dispatch mode is skipped by dynamo from then
    on (NOTE [measuring compiled steps]), so no compiled row may be measured or timed after this.
    """
    eager = planner.measure(copy.deepcopy(call.model), call.args, example_kwargs=call.kwargs).peak_bytes
    eager_allocator = allocator_step_memory(copy.deepcopy(call.model), call).peak_bytes
    module = compiled(copied_variant(variant_of(call.model)), NO_CHECKPOINTING_FRACTION).module
    under_tracker = planner.measure(module, call.args, example_kwargs=call.kwargs).peak_bytes
    afterwards = allocator_step_memory(module, call)
    return TrackerCheck(
        eager_tracker_peak_bytes=eager,
        eager_allocator_peak_bytes=eager_allocator,
        compiled_allocator_peak_bytes=compiled_none.peak_bytes if compiled_none else None,
        compiled_tracker_peak_bytes=under_tracker,
        ran_compiled_after_tracker=bool(afterwards.ran_compiled),
    )


def benchmark_model(name: str, settings: Settings) -> ModelResult:
    started_s = time.perf_counter()
    call = build_example(name, settings.device)
    result = ModelResult(name=name, device=settings.device)
    first, again = (one_step(variant_of(call.model), call.args, kwargs=call.kwargs) for _ in range(2))
    reference = with_run_to_run_noise(first, again)
    eager: list[Row] = []
    if not settings.compiled_only:
        reference_plan = optimize_at(call, REFERENCE_BUDGET_BYTES, "dp")
        predicted = PredictedRange(reference_plan)
        result.capture = reference_plan.capture
        result.predicted_min_peak_bytes = predicted.min_peak_bytes
        result.predicted_baseline_peak_bytes = predicted.baseline_peak_bytes
        eager = eager_rows(call, reference, predicted, settings)
    result.rows = eager + ([] if settings.eager_only else compiled_rows(call, reference, settings))
    if settings.device == "cpu" and not settings.eager_only:
        compiled_none = next(row for row in result.rows if row.mode is Mode.COMPILED)
        result.tracker_check = tracker_check(call, compiled_none)
    result.seconds = time.perf_counter() - started_s
    return result


def worker_threads(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // jobs)


def run_in_subprocess(name: str, settings: Settings, directory: Path) -> ModelResult:
    """One model in a fresh interpreter, its compiled code and memory die with it; stderr passes through."""
    out = directory / f"{name}.json"
    command = [
        sys.executable,
        "-m",
        "bench.compare",
        "--worker",
        name,
        "--worker-out",
        str(out),
        "--device",
        settings.device,
    ]
    command += ["--threads", str(worker_threads(settings.jobs)), *(["--quick"] if settings.quick else [])]
    command += ["--compiled-only"] if settings.compiled_only else []
    command += ["--eager-only"] if settings.eager_only else []
    try:
        subprocess.run(command, check=True, timeout=MODEL_TIMEOUT_S, cwd=REPOSITORY)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        log.error("%s failed: %s", name, error)
        return ModelResult(name=name, device=settings.device, error=f"{type(error).__name__}: {error}")
    return result_from_dict(json.loads(out.read_text()))


def longest_first(names: Sequence[str], previous: Path) -> list[str]:
    """`names` by the seconds a previous run at `previous` took, longest (and unknown) first, so that
    parallel jobs finish together."""
    try:
        models = json.loads(previous.read_text())["models"]
        seconds = {name: float(model["seconds"] or 0.0) for name, model in models.items()}
    except (OSError, ValueError, KeyError, TypeError):
        seconds = {}
    return sorted(names, key=lambda name: -seconds.get(name, math.inf))


def run_all(names: Sequence[str], settings: Settings, *, previous: Path) -> list[ModelResult]:
    """Every model in its own process, `settings.jobs` at a time; results in the order of `names`."""
    started_s = time.perf_counter()

    def run(name: str) -> ModelResult:
        log.info("%s: started (%.0f s into the run)", name, time.perf_counter() - started_s)
        result = run_in_subprocess(name, settings, Path(directory))
        log.info("%s: done (%.0f s into the run)", name, time.perf_counter() - started_s)
        return result

    with tempfile.TemporaryDirectory(prefix="compare-") as directory:
        with concurrent.futures.ThreadPoolExecutor(max_workers=settings.jobs) as pool:
            order = longest_first(names, previous)
            by_name = dict(zip(order, pool.map(run, order), strict=True))
    return [by_name[name] for name in names]


def settings_for(arguments: argparse.Namespace) -> Settings:
    return Settings(
        device=arguments.device,
        fractions=QUICK_FRACTIONS if arguments.quick else FRACTIONS,
        rounds=QUICK_TIMING_ROUNDS if arguments.quick else TIMING_ROUNDS,
        timing_s=0.0 if arguments.quick else TIMING_S,
        quick=arguments.quick,
        jobs=arguments.jobs,
        compiled_only=arguments.compiled_only,
        eager_only=arguments.eager_only,
    )


def default_out(device: str, quick: bool) -> Path:
    suffix = ("" if device == "cpu" else f"_{device.replace(':', '')}") + ("_quick" if quick else "")
    return RESULTS_DIRECTORY / f"compare{suffix}.json"


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--models",
        help=f"comma-separated subset of {','.join(MODELS)}, or of {','.join(SIZED_ZOO)} (issue 35's sizes)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}; fewer rounds and fractions"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda: a GPU run gets files of its own"
    )
    parser.add_argument(
        "--out", type=Path, help="JSON path (default bench/results/compare[_DEVICE][_quick].json)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"models at once, each with cpu_count/jobs torch threads (default {DEFAULT_JOBS})",
    )
    parser.add_argument("--render", type=Path, help="rewrite the .md and .png of a JSON this script wrote")
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--compiled-only", action="store_true", help="the compiled rows alone (no eager peers or plans)"
    )
    only.add_argument("--eager-only", action="store_true", help="the eager rows alone (no compiled ones)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    default_models = QUICK_MODELS if arguments.quick else MODELS
    names = arguments.models.split(",") if arguments.models else list(default_models)
    unknown = [name for name in names if name not in MODELS and name not in SIZED_ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join((*MODELS, *SIZED_ZOO))}")
    arguments.models = names
    arguments.out = arguments.out or default_out(arguments.device, arguments.quick)
    return arguments


def worker_main(arguments: argparse.Namespace) -> int:
    """Benchmark one model (in the subprocess the parent started) and write its result as JSON."""
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    with compiler_settings():
        result = benchmark_model(arguments.worker, settings_for(arguments))
    arguments.worker_out.write_text(json.dumps(asdict(result), allow_nan=False))
    return 0


def write_results(results: Sequence[ModelResult], out: Path, context: dict[str, Any]) -> None:
    document = {**context, "models": {result.name: asdict(result) for result in results}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1, allow_nan=False, default=str) + "\n")
    write_tables(results, out, context)


def write_tables(results: Sequence[ModelResult], out: Path, context: dict[str, Any]) -> None:
    """The markdown (also to stdout) and the plot beside the JSON at `out`."""
    table = markdown(results, context)
    out.with_suffix(".md").write_text(table)
    refresh_quotes(out.with_suffix(".md"))
    run = "quick" if context["quick"] else "full"
    plot(
        results, out.with_suffix(".png"), title=f"{context['device']}: measured peak vs step time ({run} run)"
    )
    sys.stdout.write(table)


def render(path: Path) -> int:
    """Rewrite the tables and the plot of a JSON this script wrote, without measuring anything."""
    document = json.loads(path.read_text())
    results = [result_from_dict(model) for model in document["models"].values()]
    write_tables(results, path, {key: value for key, value in document.items() if key != "models"})
    return 0


def main(argv: Sequence[str]) -> int:
    arguments = parse_arguments(argv)
    source = arguments.worker or "%(name)s"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {source}: %(message)s")
    logging.getLogger("planner").setLevel(logging.WARNING)
    if arguments.worker:
        return worker_main(arguments)
    if arguments.render:
        return render(arguments.render)
    settings = settings_for(arguments)
    started_s = time.perf_counter()
    context: dict[str, Any] = {
        "device": settings.device,
        "machine": machine(),  # before the models load the machine, so the load average is the others'
        "planner_revision": planner_revision(),
        "command": [Path(sys.executable).name, *sys.argv],
        "quick": settings.quick,
        "rounds": settings.rounds,
        "timing_s": settings.timing_s,
        "fractions": settings.fractions,
        "jobs": settings.jobs,
        "compiled_only": settings.compiled_only,
        "eager_only": settings.eager_only,
        "torch_threads_per_model": worker_threads(settings.jobs),
    }
    results = run_all(arguments.models, settings, previous=arguments.out)
    context["total_s"] = time.perf_counter() - started_s
    write_results(results, arguments.out, context)
    log.info("wrote %s (.md, .png) in %.1f s", arguments.out, context["total_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
