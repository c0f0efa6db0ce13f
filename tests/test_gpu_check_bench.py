"""`make gpu-check` (bench/gpu_check.py) runs its CPU part here, and says that it skipped the CUDA parts."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch

import planner
from bench import gpu_check
from planner.zoo import build_model


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
    for row in rows:  # each phase predicted as measured, the replay's inside backward's
        predicted, measured_phases = row["predicted_phase_bytes"], row["measured"]["phase_bytes"]
        replayed = max(predicted["backward"], predicted.get("recompute", 0))
        assert measured_phases == {
            "forward": predicted["forward"],
            "backward": replayed,
            "optimizer step": predicted["optimizer step"],
        }
    assert document["workspaces"] == {"seed000_mlp": {}}, "no library workspace off CUDA"
    (default,) = [row for row in rows if row["allocator"] == "default"]
    assert default["step_mismatch"] is None, "the plan trains as the model"
    assert (document["summary"]["stepped"], document["summary"]["trained_as_the_model"]) == (1, 1)


def test_a_plan_that_trains_otherwise_than_its_model_is_reported() -> None:
    model, inputs = build_model("seed000_mlp")
    plan = planner.optimize(model, inputs, budget_bytes=2**40)
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    call = gpu_check.Call("seed000_mlp", model, inputs, {})
    assert gpu_check._step_mismatch(plan, call) is None
    mismatch = gpu_check._step_mismatch(plan, dataclasses.replace(call, model=other))
    assert mismatch is not None
