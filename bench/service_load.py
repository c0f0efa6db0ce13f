"""Load on the solver service: N concurrent clients for T seconds against a 500-node graph, on loopback.

One experiment: start `planner serve` on 127.0.0.1 (a subprocess, its own SQLite file), solve the graph
once (the cold solve, timed), then let `--clients` threads post the same request for `--seconds`. Those
requests are answered from the job store, so this measures the service's own cost per request (parse
and validate a 500-node graph, hash it, look the job up, send the plan back), not the solver's, which
the cold solve reports. Every answer must be 200 with a plan; anything else counts as an error.

Reports throughput, latency percentiles, errors and the server's resident memory (VmRSS and its peak
VmHWM from /proc) and writes them to bench/results/service_load.json. Traffic goes to 127.0.0.1 only,
and every loop is bounded by the deadline and by `MAX_REQUESTS_PER_CLIENT`.

    .venv/bin/python bench/service_load.py --clients 8 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from planner.client import PlannerClient
from planner.serialize import graph_to_dict
from planner.simulate import simulate, store_everything
from planner.solvers import lowest_peak
from planner.synthetic import residual_graph

log = logging.getLogger("service_load")

RESULTS_PATH = Path(__file__).parent / "results" / "service_load.json"
HOST = "127.0.0.1"
MAX_REQUESTS_PER_CLIENT = 100_000
SERVER_START_TIMEOUT_S = 60.0
COLD_SOLVE_TIMEOUT_S = 600.0


@dataclass
class ClientTally:
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LoadResult:
    command: str
    graph_nodes: int
    request_body_bytes: int
    clients: int
    duration_s: float
    cold_solve_s: float
    requests: int
    errors: int
    error_samples: list[str]
    throughput_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    latency_max_ms: float
    server_rss_start_mib: float
    server_rss_end_mib: float
    server_rss_peak_mib: float
    cpu_count: int


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _memory_mib(pid: int, key: str) -> float:
    """A /proc/<pid>/status memory line (VmRSS, VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(f"/proc/{pid}/status has no {key} line")


def _start_server(database: Path, port: int, workers: int) -> subprocess.Popen[bytes]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PLANNER_")}
    command = [sys.executable, "-m", "planner.cli", "serve", "--host", HOST, "--port", str(port)]
    command += ["--db", str(database), "--workers", str(workers), "--log-level", "warning"]
    server = subprocess.Popen(command, env=environment)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before answering /healthz")
        try:
            if httpx.get(f"http://{HOST}:{port}/healthz", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.kill()
    raise TimeoutError(f"the server did not answer /healthz within {SERVER_START_TIMEOUT_S} s")


def _client_loop(url: str, body: bytes, deadline: float, tally: ClientTally) -> None:
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=60.0) as http:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline:
                return
            started = time.perf_counter()
            try:
                response = http.post(f"{url}/v1/plans", content=body, headers=headers)
                ok = response.status_code == 200 and response.json()["status"] == "done"
                problem = "" if ok else f"HTTP {response.status_code}: {response.text[:200]}"
            except (httpx.HTTPError, ValueError, KeyError) as error:
                problem = f"{type(error).__name__}: {error}"
            tally.latencies_ms.append((time.perf_counter() - started) * 1e3)
            if problem:
                tally.errors.append(problem)


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run_load(*, clients: int, seconds: float, node_count: int, workers: int) -> LoadResult:
    graph = residual_graph(node_count=node_count)
    budget_bytes = (
        lowest_peak(graph)[1].peak_bytes + simulate(graph, store_everything(graph)).peak_bytes
    ) // 2
    body = json.dumps(
        {"graph": graph_to_dict(graph), "budget_bytes": budget_bytes, "solver": "auto", "wait_s": 30}
    ).encode()
    port = _free_port()
    url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory() as directory:
        server = _start_server(Path(directory) / "jobs.sqlite3", port, workers)
        try:
            started = time.perf_counter()
            with PlannerClient(url, poll_timeout_s=COLD_SOLVE_TIMEOUT_S) as client:
                client.plan_graph(graph, budget_bytes=budget_bytes, solver="auto")
            cold_solve_s = time.perf_counter() - started
            log.info("cold solve of %d nodes: %.2f s; loading for %.0f s", node_count, cold_solve_s, seconds)
            rss_start_mib = _memory_mib(server.pid, "VmRSS")
            tallies = [ClientTally() for _ in range(clients)]
            deadline = time.monotonic() + seconds
            threads = [
                threading.Thread(target=_client_loop, args=(url, body, deadline, tally)) for tally in tallies
            ]
            load_started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            duration_s = time.perf_counter() - load_started
            rss_end_mib = _memory_mib(server.pid, "VmRSS")
            rss_peak_mib = _memory_mib(server.pid, "VmHWM")
        finally:
            server.terminate()
            server.wait(timeout=30)
    latencies = [latency for tally in tallies for latency in tally.latencies_ms]
    errors = [error for tally in tallies for error in tally.errors]
    return LoadResult(
        command=" ".join(["python", "bench/service_load.py", *sys.argv[1:]]),
        graph_nodes=node_count,
        request_body_bytes=len(body),
        clients=clients,
        duration_s=round(duration_s, 2),
        cold_solve_s=round(cold_solve_s, 2),
        requests=len(latencies),
        errors=len(errors),
        error_samples=errors[:5],
        throughput_per_s=round(len(latencies) / duration_s, 1),
        latency_p50_ms=round(statistics.median(latencies), 1),
        latency_p99_ms=round(_percentile(latencies, 0.99), 1),
        latency_max_ms=round(max(latencies), 1),
        server_rss_start_mib=round(rss_start_mib, 1),
        server_rss_end_mib=round(rss_end_mib, 1),
        server_rss_peak_mib=round(rss_peak_mib, 1),
        cpu_count=os.cpu_count() or 0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the load phase")
    parser.add_argument("--nodes", type=int, default=500, help="nodes in the synthetic graph")
    parser.add_argument("--workers", type=int, default=2, help="the server's solver threads")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would swamp the report
    result = run_load(
        clients=arguments.clients,
        seconds=arguments.seconds,
        node_count=arguments.nodes,
        workers=arguments.workers,
    )
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(asdict(result), indent=1) + "\n")
    log.info("%s", json.dumps(asdict(result), indent=1))
    if result.errors:
        raise SystemExit(
            f"{result.errors} of {result.requests} requests failed; first: {result.error_samples[0]}"
        )


if __name__ == "__main__":
    main()
