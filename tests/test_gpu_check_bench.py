"""`make gpu-check` (bench/gpu_check.py) runs its CPU part here, and says that it skipped the CUDA parts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench import gpu_check


def test_the_gpu_check_runs_its_cpu_part_and_says_what_it_skipped(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--quick", "--models", "seed000_mlp", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert not torch.cuda.is_available(), "this test describes the CPU run; on a GPU read the JSON instead"
    assert document["device"]["cuda"] == "skipped: no CUDA device on this machine"
    assert document["node_times"] == {"skipped": "no CUDA device on this machine"}
    rows = document["rows"]
    assert {row["allocator"] for row in rows} == {"default", "expandable_segments:True"}
    for row in rows:
        measured = row["measured"]
        assert measured["reserved_bytes"] is None  # the CPU has no caching allocator
        assert measured["exact_bytes"] <= measured["allocated_bytes"] <= row["budget_bytes"]
        assert abs(row["allocated_error"]) <= 0.02
        assert row["predicted_reserved_bytes"] >= row["predicted_allocator_allocated_bytes"]
    assert document["summary"]["fit"] == len(rows) == 2
