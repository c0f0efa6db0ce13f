"""The `planner` command line: one typer app that subcommands are added to (`planner serve`, ...).

    planner plan MODULE:FACTORY --budget 8GiB [--input-shape 16,128] [--solver auto] [--json plan.json]
    planner pareto zoo:gpt_tiny --plot pareto.png
    planner capacity zoo:gpt_tiny --device a100-40gb --batch 1..512 [--sequence 64] [--plot capacity.png]
    planner report plan.json
    planner serve

Exit codes scripts can use: 0 ok, 2 bad input (arguments, an unloadable model or plan, a model that
cannot be captured), 3 no plan fits the budget. Long steps (profiling, solving) show a spinner on a
terminal and a line with their duration on stderr; `--quiet` prints nothing but errors. Torch is
imported only by the commands that load a model, so `planner report` works without it.

The CLI defines no logic of its own: each command parses options and calls the public API. `serve`
runs the REST service (the package `planner_service`, installed from the folder api/, imported only when
the command runs, so that other commands and `import planner.cli` do not need the service's dependencies).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

__all__ = ["app"]

app = typer.Typer(
    name="planner",
    help="Activation-checkpoint planner for PyTorch: fit a training step into a memory budget.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO level.")] = False,
) -> None:
    """Activation-checkpoint planner for PyTorch."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


@app.command()
def serve(
    host: Annotated[
        str, typer.Option(help="Address to listen on; 0.0.0.0 for every interface.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    db: Annotated[
        str | None,
        typer.Option(
            help="Job database: an SQLite file, or a postgresql://user:password@host/db URL that "
            "replicas share (default: PLANNER_DB or ./planner-jobs.sqlite3)."
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="Solves at a time, each in its own process (default: PLANNER_WORKERS or 2)."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
) -> None:
    """Run the solver service (REST API, OpenAPI docs at /docs) under uvicorn."""
    import uvicorn

    from planner_service.main import create_app
    from planner_service.settings import Settings

    overrides: dict[str, Any] = {"db": db, "workers": workers}
    settings = Settings(**{key: value for key, value in overrides.items() if value is not None})
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level)


EXIT_OK = 0
EXIT_BAD_INPUT = 2
"""Bad arguments, an unloadable model or plan file, a model that cannot be captured (typer uses 2 too)."""
EXIT_INFEASIBLE = 3
"""No checkpoint plan fits the budget; the message says the lowest achievable peak and what dominates."""

BINARY_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{
        prefix + suffix: 2 ** (10 * power)
        for power, prefix in enumerate("kmgt", start=1)
        for suffix in ("", "b", "ib")
    },
}
"""Budget suffixes, case-insensitive. KB, MB, GB and TB count binary units, as `budget_gb` does:
`8GB` is 8 GiB = 8 * 2**30 bytes (the unit torch and nvidia-smi report in, whatever they call it)."""

BUDGET_HELP = (
    "Memory for the whole training step: 8GiB, 512MiB, 1.5G or bytes. GB/MB/KB count binary units "
    "like GiB/MiB/KiB (8GB = 8 * 2**30 bytes), as planner.optimize(budget_gb=...) does."
)
TargetArgument = Annotated[
    str,
    typer.Argument(
        metavar="MODULE:FACTORY",
        help="zoo:NAME (see planner.zoo), or a module or .py file and a function in it that returns "
        "(model, example_inputs), or a model when --input-shape is given.",
    ),
]
InputShapeOption = Annotated[
    list[str] | None,
    typer.Option(
        "--input-shape",
        help="Shape of one random example input, e.g. 16,128,256 (float32) or 8,64:int64 (zeros); "
        "repeat for each positional input.",
    ),
]
SolverOption = Annotated[str, typer.Option(help="Solver from the registry (auto, dp, ilp, chen, none).")]
OptimizerOption = Annotated[
    str,
    typer.Option(help="Optimizer of the training step: adam, adamw, sgd, sgd-momentum, adagrad, adafactor."),
]
AccumulationOption = Annotated[
    int,
    typer.Option(min=1, help="Micro-batches per optimizer step (gradient accumulation); the inputs are one."),
]
MaxGradNormOption = Annotated[
    float | None, typer.Option(help="clip_grad_norm_ to this norm before the optimizer step.")
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")]


def parse_budget(text: str) -> int:
    """`8GiB`, `512MiB`, `8GB`, `1.5G` or a byte count -> bytes (see BINARY_UNITS)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in BINARY_UNITS:
        raise typer.BadParameter(f"{text!r} is not a memory size; write e.g. 8GiB, 512MiB, 8GB or 1000000")
    size_bytes = int(float(match.group(1)) * BINARY_UNITS[unit])
    if size_bytes <= 0:
        raise typer.BadParameter(f"the budget must be positive, got {text!r}")
    return size_bytes


BudgetOption = Annotated[int, typer.Option(help=BUDGET_HELP, parser=parse_budget, metavar="SIZE")]
MemorySnapshotOption = Annotated[
    Path | None,
    typer.Option(
        help="Write the predicted step as a PyTorch memory snapshot (.pickle) for pytorch.org/memory_viz."
    ),
]


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def _stage(description: str, *, quiet: bool) -> Iterator[None]:
    """A spinner on a terminal while a long step runs, then a log line with its duration (on stderr)."""
    if quiet:
        yield
        return
    from rich.console import Console

    started = time.perf_counter()
    with Console(stderr=True).status(f"{description} ..."):
        yield
    typer.echo(f"{description}: {time.perf_counter() - started:.1f} s", err=True)


def _example_input(shape_text: str) -> Any:
    """One example input from `16,128,256` or `8x64:int64` (random normal floats, zero integers)."""
    import torch

    dims, _, dtype_name = shape_text.partition(":")
    dtype = getattr(torch, dtype_name or "float32", None)
    try:
        shape = tuple(int(dim) for dim in re.split(r"[,x]", dims.strip()))
    except ValueError:
        shape = ()
    if not shape or any(dim <= 0 for dim in shape) or not isinstance(dtype, torch.dtype):
        _fail(f"--input-shape {shape_text!r}: write positive sizes like 16,128,256, optionally :int64")
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def _import_module(name: str) -> Any:
    """A module by dotted name (the current directory first, as `python -m` does) or by .py path."""
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            _fail(f"no such file: {name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path:
        sys.path.insert(0, "")
    return importlib.import_module(name)


def load_factory(target: str) -> Callable[..., Any]:
    """The function `zoo:NAME` or `MODULE:FACTORY` names (see TargetArgument)."""
    kind, _, name = target.rpartition(":")
    if not kind or not name:
        _fail(f"{target!r} is not MODULE:FACTORY or zoo:NAME")
    if kind == "zoo":
        from planner.zoo import ZOO, build_model

        if name not in ZOO:
            _fail(f"no zoo model {name!r}; choose one of {', '.join(ZOO)}")
        return functools.partial(build_model, name)
    try:
        return getattr(_import_module(kind), name)
    except (ImportError, AttributeError) as error:
        _fail(f"cannot load {target!r}: {error}")


def load_target(target: str, input_shapes: list[str]) -> tuple[Any, Any]:
    """(model, example_inputs) from `zoo:NAME` or `MODULE:FACTORY` (see TargetArgument)."""
    import torch

    factory = load_factory(target)
    if target.startswith("zoo:"):
        if input_shapes:
            _fail("zoo models bring their own inputs; drop --input-shape")
        return factory()
    made = factory()
    if isinstance(made, torch.nn.Module):
        if not input_shapes:
            _fail(f"{target} returned a model without inputs; give --input-shape for each input")
        return made, tuple(_example_input(shape) for shape in input_shapes)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        if input_shapes:
            _fail(f"{target} returned its own example inputs; drop --input-shape")
        return made
    _fail(f"{target} must return a torch.nn.Module or (model, example_inputs), got {type(made).__name__}")


def _profile(
    target: str,
    input_shapes: list[str],
    optimizer: str,
    *,
    accumulation_steps: int,
    max_grad_norm: float | None,
    quiet: bool,
    memory_counting: str = "blocks",
) -> Any:
    """Load the target and profile one training step (`planner.profile`)."""
    import planner

    model, inputs = load_target(target, input_shapes)
    with _stage(f"capturing and profiling one training step of {target}", quiet=quiet):
        try:
            step = planner.TrainingStep(accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
            return planner.profile(
                model, inputs, optimizer=optimizer, step=step, memory_counting=memory_counting
            )
        except (planner.UnsupportedModel, ValueError, TypeError) as error:
            _fail(str(error))


def _infeasible(error: Any, graph: Any) -> NoReturn:
    from planner.report.levers import levers_at_lowest_peak, render_levers

    typer.echo(str(error), err=True)
    typer.echo("levers beyond checkpointing (estimates from the graph's bytes, not predictions):", err=True)
    typer.echo("\n".join(render_levers(levers_at_lowest_peak(graph))), err=True)
    raise typer.Exit(EXIT_INFEASIBLE)


@app.command()
def plan(
    target: TargetArgument,
    budget: BudgetOption,
    input_shape: InputShapeOption = None,
    solver: SolverOption = "auto",
    optimizer: OptimizerOption = "adam",
    accumulation_steps: AccumulationOption = 1,
    max_grad_norm: MaxGradNormOption = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the plan (planner.plan/v1) here.")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the memory timeline (.png/.svg) here.")] = None,
    budget_kind: Annotated[
        str | None,
        typer.Option(
            help="What the budget bounds: allocated (the default: max_memory_allocated, in 512-byte blocks) "
            "or reserved (CUDA's caching allocator, predicted and not yet calibrated; see docs/memory.md)."
        ),
    ] = None,
    exact_bytes: Annotated[
        bool,
        typer.Option(
            "--exact-bytes",
            help="Count tensors' own bytes (CPU training) instead of CUDA's 512-byte blocks.",
        ),
    ] = False,
    memory_snapshot: MemorySnapshotOption = None,
    quiet: QuietOption = False,
) -> None:
    """Plan activation checkpointing for a budget and print the report (exit 3 when nothing fits)."""
    import planner
    from planner.errors import format_bytes

    profiled = _profile(
        target,
        input_shape or [],
        optimizer,
        accumulation_steps=accumulation_steps,
        max_grad_norm=max_grad_norm,
        quiet=quiet,
        memory_counting="exact" if exact_bytes else "blocks",
    )
    with _stage(f"solving for a budget of {format_bytes(budget)} with {solver}", quiet=quiet):
        try:
            result = profiled.plan(budget_bytes=budget, solver=solver, budget_kind=budget_kind)
        except planner.InfeasibleBudget as error:
            _infeasible(error, profiled.graph)
        except ValueError as error:
            _fail(str(error))
    if json_path is not None:
        json_path.write_text(result.to_json())
    if plot is not None:
        result.plot_timeline(plot)
    if memory_snapshot is not None:
        result.export_memory_snapshot(memory_snapshot)
    if not quiet:
        typer.echo(result.summary())


@app.command()
def pareto(
    target: TargetArgument,
    input_shape: InputShapeOption = None,
    points: Annotated[int, typer.Option(min=2, help="Budgets from the lowest peak to no checkpointing.")] = 9,
    budget: Annotated[int | None, typer.Option(help=BUDGET_HELP, parser=parse_budget, metavar="SIZE")] = None,
    solver: SolverOption = "auto",
    optimizer: OptimizerOption = "adam",
    accumulation_steps: AccumulationOption = 1,
    max_grad_norm: MaxGradNormOption = None,
    plot: Annotated[Path | None, typer.Option(help="Write the Pareto plot (.png/.svg) here.")] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the frontier's points here.")
    ] = None,
    quiet: QuietOption = False,
) -> None:
    """Peak against recompute over budgets, beside the usual baselines; optionally plotted."""
    from planner.errors import format_bytes
    from planner.report import hand_checkpoints as whatif

    profiled = _profile(
        target,
        input_shape or [],
        optimizer,
        accumulation_steps=accumulation_steps,
        max_grad_norm=max_grad_norm,
        quiet=quiet,
    )
    graph = profiled.graph
    with _stage(f"solving at {points} budgets with {solver}", quiet=quiet):
        try:
            frontier = profiled.pareto(points=points, solver=solver)
        except ValueError as error:
            _fail(str(error))
    schedules = {
        f"planner at {format_bytes(point.budget_bytes)}": schedule
        for point in frontier.points
        if (schedule := point.schedule) is not None
    }
    rows = whatif.compare(graph, schedules)
    baselines = whatif.compare(graph, whatif.baselines(graph))
    if json_path is not None:
        documents = [
            dataclasses.asdict(row) | {"peak_phase": row.peak_phase.value} for row in rows + baselines
        ]
        json_path.write_text(json.dumps(documents, indent=1))
    if plot is not None:
        from planner.report.plots import plot_pareto

        plot_pareto(
            [(row.peak_bytes, row.overhead) for row in rows],
            plot,
            budget_bytes=budget,
            baselines={row.name: (row.peak_bytes, row.overhead) for row in baselines},
        )
    if not quiet:
        typer.echo(whatif.render_comparison(rows + baselines, baseline_bytes=frontier.baseline_peak_bytes))


def parse_sizes(text: str) -> int | range | tuple[int, ...]:
    """`1..512` (every size), `8..512:8` (a step), `1,2,4,8` (a list) or `4096` (fixed)."""
    match = re.fullmatch(r"\s*(\d+)\s*\.\.\s*(\d+)\s*(?::\s*(\d+))?\s*", text)
    try:
        if match:
            first, last, step = int(match.group(1)), int(match.group(2)), int(match.group(3) or 1)
            sizes: int | range | tuple[int, ...] = range(first, last + 1, step)
        elif "," in text:
            sizes = tuple(int(part) for part in text.split(","))
        else:
            sizes = int(text)
    except ValueError:
        sizes = ()
    values = [sizes] if isinstance(sizes, int) else list(sizes)
    if not values or any(value < 1 for value in values):
        raise typer.BadParameter(f"{text!r}: write 1..512, 8..512:8, 1,2,4,8 or a fixed size like 4096")
    return sizes


SizesOption = Annotated[
    str | None,
    typer.Option(
        help="Sizes to search (1..512, 8..512:8, 1,2,4,8) or one fixed size (4096). Search exactly one "
        "of --batch and --sequence; FACTORY(batch=..., sequence=...) gets the ones given.",
        metavar="SIZES",
    ),
]


def _search_progress(quiet: bool) -> Any:
    """A progress bar over the graphs a search obtains (rich on stderr), as a context manager that
    yields the callback `planner.capacity` takes; nothing when quiet."""
    if quiet:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )

    @contextmanager
    def bar() -> Iterator[Callable[[int, int, str], None]]:
        with progress:
            task = progress.add_task("searching sizes", total=None)

            def update(done: int, expected: int, message: str) -> None:
                progress.update(task, completed=done, total=expected, description=message)

            yield update

    return bar()


def _on_meta(factory: Callable[..., Any]) -> Callable[..., Any]:
    """`factory` run under `torch.device("meta")`: its tensors have shapes and no storage."""
    import torch

    @functools.wraps(factory)
    def build(**sizes: int) -> Any:
        with torch.device("meta"):
            return factory(**sizes)

    return build


@app.command()
def capacity(
    target: TargetArgument,
    batch: SizesOption = None,
    sequence: SizesOption = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="The card: a100-40gb, a100-80gb, h100-80gb, l40s, rtx4090 (its memory is the budget)."
        ),
    ] = None,
    budget: Annotated[int | None, typer.Option(help=BUDGET_HELP, parser=parse_budget, metavar="SIZE")] = None,
    optimizer: OptimizerOption = "adam",
    accumulation_steps: AccumulationOption = 1,
    max_grad_norm: MaxGradNormOption = None,
    bf16: Annotated[bool, typer.Option("--bf16", help="Plan the step under bf16 autocast.")] = False,
    global_batch: Annotated[
        int | None,
        typer.Option(
            min=1, help="Also weigh checkpointing, accumulation and bf16 for this many samples per step."
        ),
    ] = None,
    cost_model: Annotated[
        str | None, typer.Option(help="analytic (default with --device) or measured (on this machine).")
    ] = None,
    solver: SolverOption = "auto",
    scan: Annotated[bool, typer.Option("--scan", help="Probe every size instead of bisecting.")] = False,
    meta: Annotated[
        bool,
        typer.Option("--meta", help="Build the model and inputs on the meta device: nothing is allocated."),
    ] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Draw the largest size against 16/24/40/48/80 GiB cards (.png/.svg).")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the table here.")] = None,
    quiet: QuietOption = False,
) -> None:
    """The largest batch or sequence that fits a card, with and without checkpointing (exit 3: none)."""
    import torch

    import planner

    factory = load_factory(target)
    if meta:
        factory = _on_meta(factory)
    batch_sizes = parse_sizes(batch) if batch else None
    sequence_sizes = parse_sizes(sequence) if sequence else None
    try:
        with _search_progress(quiet) as progress:
            table = planner.capacity(
                factory,
                device=device,
                budget_bytes=budget,
                optimizer=optimizer,
                autocast=torch.bfloat16 if bf16 else None,
                step=planner.TrainingStep(accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm),
                cost_model=cost_model,
                solver=solver,
                global_batch=global_batch,
                search="scan" if scan else "bisect",
                progress=progress,
                batch=batch_sizes,
                sequence=sequence_sizes,
            )
            document = table.to_dict()
            if plot is not None:
                table.plot(plot)
    except (planner.UnsupportedModel, ValueError, TypeError) as error:
        _fail(str(error))
    if json_path is not None:
        json_path.write_text(json.dumps(document, indent=1))
    if not quiet:
        typer.echo(table.summary())
    if table.largest_with is None:
        raise typer.Exit(EXIT_INFEASIBLE)


@app.command()
def report(
    plan_path: Annotated[
        Path, typer.Argument(metavar="PLAN.json", help="A plan written by `planner plan --json`.")
    ],
    plot: Annotated[Path | None, typer.Option(help="Write the memory timeline (.png/.svg) here.")] = None,
    snippet: Annotated[
        bool, typer.Option(help="Also print the plan as torch.utils.checkpoint code.")
    ] = False,
    memory_snapshot: MemorySnapshotOption = None,
) -> None:
    """Print the report of a saved plan (no torch needed)."""
    from planner.planning.plan import Plan

    try:
        loaded = Plan.from_json(plan_path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as error:
        _fail(f"cannot read a plan from {plan_path}: {error}")
    typer.echo(loaded.summary())
    if snippet:
        typer.echo("")
        typer.echo(loaded.to_torch_snippet())
    if plot is not None:
        loaded.plot_timeline(plot)
    if memory_snapshot is not None:
        loaded.export_memory_snapshot(memory_snapshot)


if __name__ == "__main__":
    app()
