"""bench/kernel_time.py: kernel names line up across compilations, and one small run profiles inductor's
own kernels in every variant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import kernel_time


def test_kernel_names_drop_what_differs_between_compilations() -> None:
    assert kernel_time.kernel_key("graph_3_cpp_fused_relu_1") == "cpp_fused_relu_1"
    assert kernel_time.kernel_key("graph_12_cpp_fused_sum_0") == "cpp_fused_sum_0"
    assert kernel_time.kernel_key("Torch-Compiled Region: 0/3") == "Torch-Compiled Region"
    assert kernel_time.kernel_key("aten::mm") == "aten::mm"
    assert kernel_time.kernel_key("my_graph_3_kernel") == "my_graph_3_kernel"


def test_the_table_sets_the_kernels_that_differ_most_first() -> None:
    result = {
        "model": "m", "fraction": 0.5, "blocks": 2, "steps": 1, "machine": "cpu", "planner_revision": "abc",
        "command": "python -m bench.kernel_time --model m",
        "peak_bytes": {
            "no checkpointing": 2**20, "compile budget 0.5": 2**20, "ours dp": 2**19, "ours ilp": 2**19,
        },
        "kernel_ms": {
            "no checkpointing": {"a": 1.0, "b": 2.0},
            "compile budget 0.5": {"a": 1.0, "b": 1.0},
            "ours dp": {"a": 1.0, "b": 2.0},
            "ours ilp": {"a": 4.0, "b": 1.5},
        },
    }  # fmt: skip
    lines = kernel_time.markdown(result).splitlines()
    assert "| ours ilp | 0.50 | 5.50 |" in lines
    rows = [line for line in lines if line.startswith("| `")]
    assert rows == ["| `a` | 1.000 | 1.000 | 1.000 | 4.000 |", "| `b` | 2.000 | 1.000 | 2.000 | 1.500 |"]


def test_a_run_profiles_inductors_kernels_in_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "kernel_time.json"
    argv = ["--model", "seed000_mlp", "--blocks", "2", "--steps", "1", "--out", str(out)]
    assert kernel_time.main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["kernel_ms"]) == ["no checkpointing", "compile budget 0.5", "ours dp", "ours ilp"]
    for name, kernels in result["kernel_ms"].items():
        assert any(key.startswith("cpp_fused") for key in kernels), name
        assert kernels.get("aten::mm", 0.0) > 0.0, name
    peer_peak = result["peak_bytes"]["compile budget 0.5"]
    assert result["peak_bytes"]["ours ilp"] <= peer_peak
    assert out.with_suffix(".md").read_text().startswith("# Kernel self time per step: seed000_mlp")


@pytest.mark.parametrize("argv", [["--fraction", "1.0"], ["--blocks", "0"]])
def test_bad_arguments_say_what_was_wrong(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kernel_time.main(["--model", "seed000_mlp", *argv])
    assert "got" in capsys.readouterr().err
