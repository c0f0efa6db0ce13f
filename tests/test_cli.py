"""The command line through typer's CliRunner: each command, its outputs and its exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from click.testing import Result
from typer.testing import CliRunner

from planner.cli import EXIT_BAD_INPUT, EXIT_INFEASIBLE, app, parse_budget
from planner.planning.plan import Plan

MIB = 2**20
MODEL_FILE = """
import torch

def model_only():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))

def model_and_inputs():
    return model_only(), (torch.randn(32, 16),)

def not_a_model():
    return 42
"""


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny_models.py"
    path.write_text(MODEL_FILE)
    return path


@pytest.mark.parametrize(
    ("text", "size_bytes"),
    [
        ("8GiB", 8 * 2**30),
        ("8GB", 8 * 2**30),
        ("8gb", 8 * 2**30),
        ("512MiB", 512 * MIB),
        ("512 MB", 512 * MIB),
        ("1.5G", 3 * 2**29),
        ("64KiB", 64 * 2**10),
        ("1000000", 1_000_000),
        ("2TiB", 2 * 2**40),
    ],
)
def test_budget_strings_count_binary_units(text: str, size_bytes: int) -> None:
    assert parse_budget(text) == size_bytes


@pytest.mark.parametrize("text", ["", "GiB", "8 potatoes", "-1GiB", "0MiB", "8PB"])
def test_bad_budget_strings_are_rejected(text: str) -> None:
    with pytest.raises(typer.BadParameter):
        parse_budget(text)


@pytest.fixture(scope="module")
def planned(runner: CliRunner, tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path, Path]:
    """`planner plan` on seed 000's MLP with --json and --plot: (result, plan path, plot path)."""
    directory = tmp_path_factory.mktemp("planned")
    json_path, plot_path = directory / "plan.json", directory / "timeline.png"
    arguments = [
        "plan",
        "zoo:seed000_mlp",
        "--budget",
        "20MiB",
        "--json",
        str(json_path),
        "--plot",
        str(plot_path),
    ]
    return runner.invoke(app, arguments), json_path, plot_path


def test_plan_writes_json_and_plot_and_prints_the_report(planned: tuple[Result, Path, Path]) -> None:
    result, json_path, plot_path = planned
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(json_path.read_text())
    assert plan.budget_bytes == 20 * MIB and plan.predicted_peak_bytes <= 20 * MIB
    assert plot_path.read_bytes().startswith(b"\x89PNG")
    assert plan.summary() in result.stdout
    assert "capturing and profiling one training step of zoo:seed000_mlp" in result.stderr
    assert "solving for a budget of 20.00 MiB" in result.stderr


def test_report_prints_a_saved_plan_and_its_snippet(
    runner: CliRunner, planned: tuple[Result, Path, Path], tmp_path: Path
) -> None:
    _, json_path, _ = planned
    plan = Plan.from_json(json_path.read_text())
    result = runner.invoke(app, ["report", str(json_path), "--snippet", "--plot", str(tmp_path / "t.svg")])
    assert result.exit_code == 0, result.output
    assert (
        plan.summary() in result.stdout and "from torch.utils.checkpoint import checkpoint" in result.stdout
    )
    assert (tmp_path / "t.svg").exists()


def test_an_infeasible_budget_exits_3_with_the_minimum_and_the_levers(runner: CliRunner) -> None:
    result = runner.invoke(app, ["plan", "zoo:seed000_mlp", "--budget", "10MiB", "--quiet"])
    assert result.exit_code == EXIT_INFEASIBLE, result.output
    assert "no checkpoint plan fits a budget of 10.00 MiB" in result.stderr
    assert "8-bit Adam" in result.stderr and "(estimate, -" in result.stderr
    assert result.stdout == ""


def test_plan_takes_the_training_step(runner: CliRunner, model_file: Path) -> None:
    arguments = ["plan", f"{model_file}:model_only", "--budget", "1GB", "--input-shape", "32,16"]
    result = runner.invoke(app, [*arguments, "--accumulation-steps", "2", "--max-grad-norm", "1.0"])
    assert result.exit_code == 0, result.output
    assert "in the second micro-batch (and every later one), with all gradients alive" in result.output
    result = runner.invoke(app, [*arguments, "--accumulation-steps", "0"])
    assert result.exit_code == 2 and "accumulation-steps" in result.output


def test_a_factory_returning_a_model_takes_input_shapes(runner: CliRunner, model_file: Path) -> None:
    target = f"{model_file}:model_only"
    result = runner.invoke(app, ["plan", target, "--budget", "1GB", "--input-shape", "32,16", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == ""
    result = runner.invoke(app, ["plan", f"{model_file}:model_and_inputs", "--budget", "1GB"])
    assert result.exit_code == 0, result.output
    assert "budget                              1.00 GiB" in result.stdout


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["plan", "no_such_module_anywhere:make", "--budget", "1GiB"], "cannot load"),
        (["plan", "zoo:no_such_model", "--budget", "1GiB"], "no zoo model 'no_such_model'"),
        (["plan", "zoo:seed000_mlp", "--budget", "1GiB", "--input-shape", "4,4"], "drop --input-shape"),
        (["plan", "{file}:model_only", "--budget", "1GiB"], "give --input-shape"),
        (["plan", "{file}:model_only", "--budget", "1GiB", "--input-shape", "4,-1"], "positive sizes"),
        (["plan", "{file}:not_a_model", "--budget", "1GiB"], "must return a torch.nn.Module"),
        (["plan", "{file}:model_and_inputs", "--budget", "1GiB", "--solver", "magic"], "solver='magic'"),
        (["plan", "just_a_name", "--budget", "1GiB"], "not MODULE:FACTORY"),
        (["plan", "zoo:seed000_mlp", "--budget", "lots"], "is not a memory size"),
        (["report", "{file}"], "cannot read a plan"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    runner: CliRunner, model_file: Path, arguments: list[str], message: str
) -> None:
    result = runner.invoke(app, [argument.format(file=model_file) for argument in arguments])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert message in result.output


def test_pareto_tabulates_plots_and_saves_the_frontier_beside_the_baselines(
    runner: CliRunner, tmp_path: Path
) -> None:
    plot_path, json_path = tmp_path / "pareto.svg", tmp_path / "frontier.json"
    arguments = ["pareto", "zoo:seed003_feedforward", "--points", "4", "--budget", "110MiB", "--solver", "dp"]
    result = runner.invoke(app, [*arguments, "--plot", str(plot_path), "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    assert b"<svg" in plot_path.read_bytes()[:2000]
    rows = json.loads(json_path.read_text())
    names = [row["name"] for row in rows]
    assert names[-3:] == [
        "no checkpointing",
        "sqrt(n) segments (4, checkpoint_sequential)",
        "every block of layers (Hugging Face)",
    ]
    assert sum(name.startswith("planner at ") for name in names) == 4
    assert all(row["peak_bytes"] > 0 and row["overhead"] >= 0 for row in rows)
    assert "every block of layers (Hugging Face)" in result.stdout


def test_capacity_prints_the_table_writes_json_and_plots_card_memories(
    runner: CliRunner, tmp_path: Path
) -> None:
    plot_path, json_path = tmp_path / "capacity.png", tmp_path / "capacity.json"
    arguments = [
        "capacity",
        "zoo:seed000_mlp",
        "--device",
        "cpu",
        "--budget",
        "16MiB",
        "--batch",
        "256..1024:256",
    ]
    result = runner.invoke(
        app, [*arguments, "--solver", "dp", "--plot", str(plot_path), "--json", str(json_path)]
    )
    assert result.exit_code == 0, result.output
    table = json.loads(json_path.read_text())
    assert table["dimension"] == "batch" and table["budget_bytes"] == 16 * MIB
    largest = table["largest_with"]
    assert largest in (256, 512, 768) and table["largest_without"] < largest
    assert f"largest batch with checkpointing     {largest}" in result.stdout
    fitting = [row for row in table["rows"] if row["min_peak_bytes"] <= 16 * MIB]
    assert max(row["size"] for row in fitting) == largest
    assert plot_path.read_bytes().startswith(b"\x89PNG")


def test_capacity_exits_3_when_nothing_fits_and_2_on_bad_sizes(runner: CliRunner) -> None:
    arguments = ["capacity", "zoo:seed000_mlp", "--device", "cpu", "--quiet"]
    result = runner.invoke(app, [*arguments, "--budget", "1MiB", "--batch", "256,512"])
    assert result.exit_code == EXIT_INFEASIBLE, result.output
    result = runner.invoke(app, [*arguments, "--budget", "1GiB", "--batch", "0..4"])
    assert result.exit_code == EXIT_BAD_INPUT and "write 1..512" in result.output
    result = runner.invoke(app, [*arguments, "--budget", "1GiB", "--batch", "64"])
    assert result.exit_code == EXIT_BAD_INPUT and "search exactly one of batch= or sequence=" in result.output
    result = runner.invoke(app, [*arguments, "--batch", "64..128"])
    assert result.exit_code == EXIT_BAD_INPUT and "does not say how much memory it has" in result.output
    result = runner.invoke(app, [*arguments, "--budget", "1GiB", "--batch", "64..128", "--sequence", "64"])
    assert result.exit_code == EXIT_BAD_INPUT and "does not take sequence" in result.output


def test_capacity_on_the_meta_device_plans_for_a_named_card(runner: CliRunner, tmp_path: Path) -> None:
    json_path = tmp_path / "capacity.json"
    arguments = ["capacity", "zoo:seed000_mlp", "--meta", "--device", "h100-80gb", "--batch", "256,1024"]
    plot_path = tmp_path / "cards.png"
    result = runner.invoke(app, [*arguments, "--quiet", "--json", str(json_path), "--plot", str(plot_path)])
    assert result.exit_code == 0, result.output
    assert plot_path.stat().st_size > 0
    table = json.loads(json_path.read_text())
    held_back = 2**30 + 2 * 32 * 2**20  # the CUDA context allowance and two 32 MiB cuBLAS workspaces
    assert table["card"] == "h100-80gb" and table["budget_bytes"] == 85_017_493_504 - held_back
    assert table["held_back_bytes"] == held_back
    assert table["timing"] == "analytic (h100-80gb)" and table["largest_without"] == 1024
    assert "the largest batch searched fits: search higher to find the limit" in table["notes"]
