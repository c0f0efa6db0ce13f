"""Helpers for the service tests: small and slow graphs and their JSON, budgets, a real server process,
polling, and the solver processes a server forks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

from planner.ir import ActivationGraph
from planner.serialize import graph_to_dict
from planner.simulation.step import simulate, store_everything
from planner.solvers import lowest_peak
from planner.testing.synthetic_graphs import residual_graph

SERVER_START_TIMEOUT_S = 30.0
WAIT_TIMEOUT_S = 30.0
SLOW_GRAPH = residual_graph(node_count=41, nodes_per_block=10)
"""A solve that is honest work: `ilp` on it runs about 9 s on 2 cores (its limit is 10 s)."""

T = TypeVar("T")


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


SLOW_BUDGET_BYTES = middle_budget(SLOW_GRAPH)


def slow_body(budget_bytes: int = SLOW_BUDGET_BYTES, **options: Any) -> dict[str, Any]:
    return plan_body(SLOW_GRAPH, budget_bytes, solver="ilp", **options)


def wait_until(probe: Callable[[], T | None], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> T:
    """Poll `probe` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")


def solver_children(server_pid: int | None = None) -> list[int]:
    """Pids of a server's solver children (this process's by default): forked by its forkserver."""
    server_pid = os.getpid() if server_pid is None else server_pid
    processes = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes()
            except OSError:  # the process ended while we looked
                continue
            processes[int(entry.name)] = (int(fields[1]), b"forkserver" in command)
    forkservers = {pid for pid, (parent, is_fork) in processes.items() if is_fork and parent == server_pid}
    return [pid for pid, (parent, _) in processes.items() if parent in forkservers]
