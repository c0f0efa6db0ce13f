"""bench/region_overhead.py: the probe schedules each checkpoint one node, and one short run writes a row
per schedule whose predicted figures are the simulator's."""

from __future__ import annotations

import json
from pathlib import Path

import planner
from bench import region_overhead
from planner.report.hand_checkpoints import hand_schedules
from planner.simulation.step import simulate
from planner.zoo import build_model


def test_each_probe_checkpoints_one_node_and_the_probes_spread_over_the_graph() -> None:
    model, inputs = build_model("seed000_mlp")
    graph = planner.profile(model, inputs).graph
    probes = region_overhead.single_node_schedules(graph, 3)
    assert len(probes) == 3
    starts = []
    for name, schedule in probes.items():
        (region,) = schedule.checkpointed
        assert region.stop == region.start + 1 and name.startswith(f"node {region.start} alone")
        assert [r.start for r in schedule.regions] == sorted(r.start for r in schedule.regions)
        assert schedule.regions[-1].stop == len(graph.nodes)
        starts.append(region.start)
    assert starts[0] < len(graph.nodes) // 3 < starts[-1], starts
    assert region_overhead.single_node_schedules(graph, 0) == {}


def test_a_short_run_writes_a_row_per_schedule_with_the_simulators_prediction(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    code = region_overhead.main(
        ["--models", "seed000_mlp", "--probes", "2", "--seconds", "0", "--out", str(out)]
    )
    assert code == 0
    document = json.loads(out.read_text())
    model = document["models"]["seed000_mlp"]
    model_call, inputs = build_model("seed000_mlp")
    graph = planner.profile(model_call, inputs).graph
    expected = {**region_overhead.single_node_schedules(graph, 2), **hand_schedules(graph)}
    assert [row["schedule"] for row in model["rows"]] == list(expected)
    for row in model["rows"]:
        predicted = simulate(graph, expected[row["schedule"]])
        assert row["regions"] == len(expected[row["schedule"]].checkpointed)
        assert abs(row["predicted_recompute_ms"] - predicted.recompute_ms) <= 0.5 * predicted.recompute_ms
        assert row["rounds"] == region_overhead.MIN_ROUNDS and row["measured_extra_interval_ms"] is not None
    assert "| sqrt(n) segments" in out.with_suffix(".md").read_text()
