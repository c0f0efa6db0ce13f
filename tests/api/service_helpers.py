"""Helpers for the service tests: small graphs and their JSON, budgets, and a real server process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from planner.ir import ActivationGraph
from planner.serialize import graph_to_dict
from planner.simulate import simulate, store_everything
from planner.solvers import lowest_peak
from planner.synthetic import residual_graph

SERVER_START_TIMEOUT_S = 30.0


def small_graph(node_count: int = 21, seed: int = 0) -> ActivationGraph:
    """A graph the solvers finish in well under a second."""
    return residual_graph(node_count=node_count, nodes_per_block=5, seed=seed)


def middle_budget(graph: ActivationGraph, fraction: float = 0.5) -> int:
    """A budget `fraction` of the way from the lowest achievable peak to the peak without checkpointing."""
    _, lowest = lowest_peak(graph)
    baseline = simulate(graph, store_everything(graph))
    return int(lowest.peak_bytes + fraction * (baseline.peak_bytes - lowest.peak_bytes))


def plan_body(graph: ActivationGraph, budget_bytes: int, **options: Any) -> dict[str, Any]:
    return {"graph": graph_to_dict(graph), "budget_bytes": budget_bytes, "solver": "dp", **options}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running_server(
    db: Path | str,
    *,
    port: int,
    workers: int = 1,
    token: str | None = None,
    settings: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`planner serve` in a subprocess on 127.0.0.1:`port`; killed (SIGKILL) on exit if still running.

    `db` is an SQLite file or a PostgreSQL URL; `settings` are more PLANNER_* variables.
    """
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PLANNER_")}
    environment.update(settings or {})
    if token is not None:
        environment["PLANNER_TOKEN"] = token
    command = [
        sys.executable,
        "-m",
        "planner.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--db",
        str(db),
        "--workers",
        str(workers),
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, env=environment)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process)
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)


def wait_until_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it answered /healthz")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the server at {url} did not answer /healthz within {SERVER_START_TIMEOUT_S} s")
