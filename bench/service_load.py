"""Load on the solver service: distinct graphs solved cold, then the same requests again, on 1 and 2 replicas.

One experiment, three set-ups on loopback: one replica on SQLite, one replica on PostgreSQL, and two
replicas sharing one PostgreSQL (requests alternate between them, as a round-robin balancer would).
In each, `--clients` threads first post `--graphs-per-size` distinct synthetic graphs of each size in
`--sizes` (different seeds, so every one is a cold solve), then post every request again (answered from
the job store: the service's own cost per request). A request that gets 202 polls its job until done.

Reports per set-up the cold solves' throughput (distinct jobs per second of wall time) and latency
(post to plan, queueing included) at p50 and p99 per graph size, and the repeats' throughput and latency;
every answer must be a plan, anything else counts as an error. Writes bench/results/service_load.json;
docs/service.md (Load) states it in a table by hand.
PostgreSQL is a throwaway server started from Debian's binaries (tests/api/postgres_server.py), unless
`--postgres-url` names one (each set-up then creates a database of its own on it).

    .venv/bin/python -m bench.service_load --sizes 100 300 900 --graphs-per-size 16 --clients 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from planner.serialize import graph_to_dict
from planner.simulation.step import simulate, store_everything
from planner.solvers import lowest_peak
from planner.testing.synthetic_graphs import residual_graph
from tests.api.postgres_server import fresh_database, running_postgres  # the tests' one copy
from tests.api.service_helpers import free_port, wait_until_healthy

log = logging.getLogger("service_load")

RESULTS_PATH = Path(__file__).parent / "results" / "service_load.json"
HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.05
SHUFFLE_SEED = 0


@dataclass(frozen=True)
class Request:
    node_count: int
    body: bytes


@dataclass(frozen=True)
class Answer:
    node_count: int
    latency_ms: float
    error: str


@dataclass(frozen=True)
class SizeFigures:
    node_count: int
    requests: int
    latency_p50_ms: float
    latency_p99_ms: float


@dataclass(frozen=True)
class PhaseFigures:
    requests: int
    errors: int
    error_samples: list[str]
    wall_s: float
    throughput_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    by_size: list[SizeFigures]


@dataclass(frozen=True)
class SetupResult:
    setup: str
    replicas: int
    store: str
    workers_per_replica: int
    cold: PhaseFigures
    repeat: PhaseFigures


def build_requests(*, sizes: list[int], graphs_per_size: int, solver: str) -> list[Request]:
    """One request per (size, seed), at a budget halfway between the lowest and the baseline peak."""
    requests = []
    for node_count in sizes:
        for seed in range(graphs_per_size):
            graph = residual_graph(node_count=node_count, seed=seed)
            lowest = lowest_peak(graph)[1].peak_bytes
            budget_bytes = (lowest + simulate(graph, store_everything(graph)).peak_bytes) // 2
            document = {"graph": graph_to_dict(graph), "budget_bytes": budget_bytes, "solver": solver}
            requests.append(Request(node_count, json.dumps({**document, "wait_s": 30}).encode()))
    random.Random(SHUFFLE_SEED).shuffle(requests)
    return requests


def _serve(database: str, port: int, workers: int) -> subprocess.Popen[bytes]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PLANNER_")}
    command = [sys.executable, "-m", "planner.cli", "serve", "--host", HOST, "--port", str(port)]
    command += ["--db", database, "--workers", str(workers), "--log-level", "warning"]
    server = subprocess.Popen(command, env=environment)
    try:
        wait_until_healthy(f"http://{HOST}:{port}", server)
    except BaseException:
        server.kill()
        raise
    return server


@contextmanager
def replicas(database: str, *, count: int, workers: int) -> Iterator[list[str]]:
    """`count` servers on one database; their URLs. Stopped (SIGTERM) on exit."""
    servers: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for _ in range(count):
            port = free_port()
            servers.append(_serve(database, port, workers))
            urls.append(f"http://{HOST}:{port}")
        yield urls
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=30)


def _post_until_done(http: httpx.Client, url: str, request: Request) -> Answer:
    started = time.perf_counter()
    try:
        response = http.post(
            f"{url}/v1/plans", content=request.body, headers={"Content-Type": "application/json"}
        )
        while response.status_code == 202:
            time.sleep(POLL_INTERVAL_S)
            response = http.get(f"{url}{response.headers['Location']}")
        ok = response.status_code == 200 and response.json()["status"] == "done"
        problem = "" if ok else f"HTTP {response.status_code}: {response.text[:200]}"
    except (httpx.HTTPError, ValueError, KeyError) as error:
        problem = f"{type(error).__name__}: {error}"
    return Answer(request.node_count, (time.perf_counter() - started) * 1e3, problem)


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run_phase(urls: list[str], requests: list[Request], *, clients: int) -> PhaseFigures:
    """Post every request once, `clients` at a time, alternating between the replicas' URLs."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http, ThreadPoolExecutor(max_workers=clients) as pool:
        started = time.perf_counter()
        answers = list(
            pool.map(
                lambda item: _post_until_done(http, urls[item[0] % len(urls)], item[1]), enumerate(requests)
            )
        )
        wall_s = time.perf_counter() - started
    latencies = [answer.latency_ms for answer in answers]
    errors = [answer.error for answer in answers if answer.error]
    by_size = []
    for node_count in sorted({answer.node_count for answer in answers}):
        sized = [answer.latency_ms for answer in answers if answer.node_count == node_count]
        by_size.append(
            SizeFigures(
                node_count=node_count,
                requests=len(sized),
                latency_p50_ms=round(statistics.median(sized), 1),
                latency_p99_ms=round(_percentile(sized, 0.99), 1),
            )
        )
    return PhaseFigures(
        requests=len(answers),
        errors=len(errors),
        error_samples=errors[:5],
        wall_s=round(wall_s, 2),
        throughput_per_s=round(len(answers) / wall_s, 2),
        latency_p50_ms=round(statistics.median(latencies), 1),
        latency_p99_ms=round(_percentile(latencies, 0.99), 1),
        by_size=by_size,
    )


def run_setup(
    name: str, database: str, *, count: int, workers: int, requests: list[Request], clients: int
) -> SetupResult:
    with replicas(database, count=count, workers=workers) as urls:
        cold = run_phase(urls, requests, clients=clients)
        repeat = run_phase(urls, requests, clients=clients)
    log.info("%s: cold %.2f jobs/s, repeats %.1f req/s", name, cold.throughput_per_s, repeat.throughput_per_s)
    store = "postgresql" if database.startswith("postgresql://") else "sqlite"
    return SetupResult(name, count, store, workers, cold, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 900], help="graph sizes, nodes")
    parser.add_argument("--graphs-per-size", type=int, default=16, help="distinct graphs (seeds) per size")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--workers", type=int, default=2, help="solves at a time per replica")
    parser.add_argument("--solver", default="dp", help="the solver every request names")
    parser.add_argument("--postgres-url", help="an existing server to use instead of a throwaway one")
    arguments = parser.parse_args()
    load_average = os.getloadavg()[0]
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would swamp the report
    requests = build_requests(
        sizes=arguments.sizes, graphs_per_size=arguments.graphs_per_size, solver=arguments.solver
    )
    log.info("%d distinct requests built; measuring", len(requests))
    common = {"workers": arguments.workers, "requests": requests, "clients": arguments.clients}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as directory:
        server_url = arguments.postgres_url or stack.enter_context(running_postgres())
        results = [
            run_setup("1 replica, SQLite", str(Path(directory) / "jobs.sqlite3"), count=1, **common),
            run_setup("1 replica, PostgreSQL", fresh_database(server_url), count=1, **common),
            run_setup("2 replicas, one PostgreSQL", fresh_database(server_url), count=2, **common),
        ]
    report = {
        "command": " ".join(["python", "-m", "bench.service_load", *sys.argv[1:]]),
        "cpu_count": os.cpu_count(),
        "load_average_1min_at_start": round(load_average, 2),
        "setups": [asdict(result) for result in results],
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(report, indent=1) + "\n")
    log.info("wrote %s", RESULTS_PATH)
    failures = [
        (result.setup, phase) for result in results for phase in (result.cold, result.repeat) if phase.errors
    ]
    if failures:
        setup, phase = failures[0]
        raise SystemExit(
            f"{setup}: {phase.errors} of {phase.requests} requests failed; first: {phase.error_samples[0]}"
        )


if __name__ == "__main__":
    main()
