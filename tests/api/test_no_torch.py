"""The service's whole import and request path runs without importing torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_serving_a_plan_and_a_frontier_never_imports_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = textwrap.dedent(
        f"""
        import sys
        from fastapi.testclient import TestClient
        import planner.cli
        from planner_service.main import create_app
        from planner_service.settings import Settings
        from planner.client import PlannerClient
        from planner.serialize import graph_to_dict
        from planner.testing.synthetic_graphs import residual_graph

        graph = residual_graph(node_count=21, nodes_per_block=5)
        with TestClient(create_app(Settings(db={str(tmp_path / "jobs.sqlite3")!r}))) as http:
            plan = PlannerClient("http://testserver", http=http).plan_graph(graph, budget_bytes=2**40)
            assert plan.predicted_peak_bytes <= 2**40
            frontier = http.post("/v1/pareto", json={{"graph": graph_to_dict(graph), "points": 2}})
            assert frontier.status_code == 200, frontier.text
        loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
        assert not loaded, loaded
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
