"""`PlannerClient`: plan through a planner service, with the same result as `planner.optimize`.

The model never leaves this process: `optimize` profiles it here with `planner.profile` (the same
capture chain, module level and arguments as `planner.optimize`), posts only the activation graph
(`planner.graph/v1` JSON) to the service, waits for the plan, and rewrites the model here with the
returned schedule (`Profile.apply`). `plan_profile` does the last two steps for a profile made
beforehand. The service needs no torch; this side does. `plan_graph` is the torch-free half: post a
graph, get a `Plan` without a module.

Network behaviour: every request has a timeout; connection errors, timeouts and 502/503/504 answers
are retried with exponential backoff (honouring the service's Retry-After), which is safe because
posting the same request twice maps to the same job. A job the service could not finish in its
`wait_s` is polled until `poll_timeout_s`. Errors carry the service's own message: an infeasible budget
raises `InfeasibleBudget` with the service's lowest achievable peak, anything else `ServiceError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import httpx

from planner.errors import InfeasibleBudget, ServiceError
from planner.ir import (
    ActivationGraph,
    BudgetKind,
    CostModel,
    MemoryCounting,
    Sharding,
    TrainingStep,
    breakdown_from,
)
from planner.planning.plan import Plan
from planner.serialize import graph_to_dict, schedule_from_dict
from planner.simulation.allocator import AllocatorSettings

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from planner.planning.model import Profile
    from planner.profiler.cost_model import DeviceSpec
    from planner.profiler.measurement import OptimizerSpec

__all__ = ["PlannerClient"]

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({502, 503, 504})
MAX_BACKOFF_S = 30.0
SERVER_WAIT_S = 10.0
"""How long each POST asks the service to hold the answer before it returns a job to poll."""
POLL_INTERVALS_S = (0.1, 0.2, 0.5, 1.0, 2.0)
"""Waits between polls of an unfinished job: quick at first, then every two seconds."""


class PlannerClient:
    """A client of one planner service at `url` (e.g. "http://127.0.0.1:8000")."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        poll_timeout_s: float = 3600.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        http: httpx.Client | None = None,
    ) -> None:
        """`timeout_s` bounds each HTTP request, `poll_timeout_s` the wait for one plan; `http` replaces
        the HTTP client (a test passes FastAPI's TestClient)."""
        if retries < 0 or backoff_s < 0 or timeout_s <= 0 or poll_timeout_s <= 0:
            raise ValueError(
                f"retries and backoff_s must be >= 0 and the timeouts > 0; got retries={retries}, "
                f"backoff_s={backoff_s}, timeout_s={timeout_s}, poll_timeout_s={poll_timeout_s}"
            )
        self.url = url.rstrip("/")
        self.poll_timeout_s = poll_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = http or httpx.Client(timeout=timeout_s + SERVER_WAIT_S)
        self._http.headers.update(headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PlannerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def plan_graph(
        self,
        graph: ActivationGraph,
        *,
        budget_bytes: int,
        solver: str = "auto",
        budget_kind: BudgetKind | str = BudgetKind.ALLOCATED,
        allocator: AllocatorSettings | None = None,
    ) -> Plan:
        """Have the service solve `graph` for `budget_bytes` of `budget_kind` memory ("allocated" or
        "reserved" under `allocator`'s settings, see `planner.plan_graph`): a Plan without a module
        (torch-free)."""
        body = {
            "graph": graph_to_dict(graph),
            "budget_bytes": budget_bytes,
            "solver": solver,
            "budget_kind": budget_kind,
            "allocator_conf": (allocator or AllocatorSettings()).to_conf(),
            "wait_s": SERVER_WAIT_S,
        }
        job = self._request("POST", "/v1/plans", json=body)
        deadline = time.monotonic() + self.poll_timeout_s
        polls = 0
        while job["status"] not in ("done", "failed"):
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"job {job['id']} at {self.url} did not finish within {self.poll_timeout_s:.0f} s "
                    f"(status {job['status']!r}); raise poll_timeout_s or fetch it later from "
                    f"{self.url}/v1/plans/{job['id']}"
                )
            time.sleep(POLL_INTERVALS_S[min(polls, len(POLL_INTERVALS_S) - 1)])
            polls += 1
            job = self._request("GET", f"/v1/plans/{job['id']}")
        if job["status"] == "failed":
            raise _job_error(job)
        document = job["plan"]
        return Plan(
            graph=graph,
            schedule=schedule_from_dict(document["schedule"]),
            budget_bytes=int(document["budget_bytes"]),
            min_peak_bytes=int(document["min_peak_bytes"]),
            solve_ms=float(document["solve_ms"]),
            budget_kind=BudgetKind(document.get("budget_kind", BudgetKind.ALLOCATED.value)),
        )

    def plan_profile(
        self,
        profile: Profile,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        solver: str = "auto",
    ) -> Plan:
        """`profile.plan(...)`, with the solve done by the service: the profile's graph is posted and
        the model rewritten here with the schedule that comes back."""
        from planner.planning.arguments import budget_bytes_of

        budget = budget_bytes_of(budget_gb, budget_bytes)
        return profile.apply(self.plan_graph(profile.graph, budget_bytes=budget, solver=solver))

    def optimize(
        self,
        model: torch.nn.Module,
        example_inputs: Any = (),
        *,
        example_kwargs: Mapping[str, Any] | None = None,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        optimizer: OptimizerSpec = "adam",
        step: TrainingStep | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        solver: str = "auto",
        cost_model: CostModel | str = CostModel.MEASURED,
        device: str | DeviceSpec | None = None,
        world_size: int = 1,
        sharding: Sharding | str = Sharding.DDP,
        reshard_after_forward: bool = True,
        compile: bool = False,
        memory_counting: MemoryCounting | str = MemoryCounting.BLOCKS,
        budget_kind: BudgetKind | str | None = None,
        allocator_conf: str | None = None,
        tensor_parallel: DeviceMesh | None = None,
    ) -> Plan:
        """`planner.optimize`, with the solve done by the service: the same arguments, checked the same
        way before profiling, and the same errors (`InfeasibleBudget` carries the service's lowest
        achievable peak). `compile=True` is refused: the compiled step is planned inside inductor's
        partitioner, in the process that compiles (planner/compiled/optimize.py). So is
        `tensor_parallel`: the ranks of the mesh merge their graphs and take rank 0's plan by collectives
        inside `planner.optimize` (planner/planning/tensor_parallel.py)."""
        # Imported here so that `plan_graph` works where torch is not installed.
        from planner.one_call import on_card
        from planner.planning.arguments import allocator_settings_of, budget_and_card
        from planner.planning.model import profile
        from planner.solvers import check_solver

        budget, card = budget_and_card(budget_gb, budget_bytes, device)
        check_solver(solver)
        allocator = allocator_settings_of(allocator_conf)
        if tensor_parallel is not None:
            raise ValueError(
                "PlannerClient.optimize(..., tensor_parallel=mesh) is not supported: the ranks of the mesh "
                "agree on one plan by collectives inside planner.optimize; call "
                "planner.optimize(model, ..., tensor_parallel=mesh) in every rank instead"
            )
        if compile:
            raise ValueError(
                "PlannerClient.optimize(..., compile=True) is not supported: the compiled step is planned "
                "while torch.compile partitions it, in the process that compiles; call "
                "planner.optimize(model, ..., compile=True) here instead"
            )
        profiled = profile(
            model,
            example_inputs,
            example_kwargs=example_kwargs,
            optimizer=optimizer,
            step=step,
            loss_fn=loss_fn,
            cost_model=cost_model,
            device=device,
            world_size=world_size,
            sharding=sharding,
            memory_counting=memory_counting,
            reshard_after_forward=reshard_after_forward,
        )
        kind = profiled.default_budget_kind if budget_kind is None else budget_kind
        planned = self.plan_graph(
            profiled.graph, budget_bytes=budget, solver=solver, budget_kind=kind, allocator=allocator
        )
        return on_card(profiled.apply(planned), card)

    def _request(self, method: str, path: str, *, json: dict[str, Any] | None = None) -> dict[str, Any]:
        """One API call with retries; the decoded JSON body of a 2xx answer."""
        for attempt in range(self.retries + 1):
            last_attempt = attempt == self.retries
            try:
                response = self._http.request(method, f"{self.url}{path}", json=json)
            except httpx.TransportError as error:
                if last_attempt:
                    raise ServiceError(
                        f"cannot reach the planner service at {self.url} ({type(error).__name__}: {error}) "
                        f"after {self.retries + 1} attempts; is it running (`planner serve`)?"
                    ) from error
                self._back_off(attempt, None, f"{type(error).__name__}: {error}")
                continue
            if response.status_code in RETRYABLE_STATUS and not last_attempt:
                self._back_off(attempt, response.headers.get("Retry-After"), f"HTTP {response.status_code}")
                continue
            if response.is_success:
                body: dict[str, Any] = response.json()
                return body
            raise _response_error(response)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _back_off(self, attempt: int, retry_after: str | None, reason: str) -> None:
        delay_s = self.backoff_s * 2**attempt
        if retry_after is not None and retry_after.isdigit():
            delay_s = max(delay_s, float(retry_after))
        delay_s = min(delay_s, MAX_BACKOFF_S)
        log.info("planner service: %s; retrying in %.1f s", reason, delay_s)
        time.sleep(delay_s)


def _message(body: Any) -> str:
    """The service's error text: each detail entry as `field: message`."""
    if not isinstance(body, dict) or not isinstance(body.get("detail"), list):
        return str(body)
    parts = []
    for item in body["detail"]:
        location = ".".join(str(part) for part in item.get("loc", ()))
        parts.append(f"{location}: {item.get('msg')}" if location else str(item.get("msg")))
    return "; ".join(parts)


def _response_error(response: httpx.Response) -> Exception:
    try:
        body = response.json()
    except ValueError:
        body = response.text
    if isinstance(body, dict) and body.get("min_peak_bytes") is not None:
        return InfeasibleBudget(
            budget_bytes=int(body["budget_bytes"]),
            min_peak_bytes=int(body["min_peak_bytes"]),
            breakdown=breakdown_from(body.get("breakdown") or {}),
        )
    return ServiceError(
        f"the planner service answered {response.status_code} to {response.request.method} "
        f"{response.request.url.path}: {_message(body)}",
        status_code=response.status_code,
    )


def _job_error(job: dict[str, Any]) -> Exception:
    error = job.get("error") or {}
    if error.get("type") == "infeasible_budget" and error.get("min_peak_bytes") is not None:
        return InfeasibleBudget(
            budget_bytes=int(error["budget_bytes"]),
            min_peak_bytes=int(error["min_peak_bytes"]),
            breakdown=breakdown_from(error.get("breakdown") or {}),
        )
    return ServiceError(f"planner job {job['id']} failed ({error.get('type')}): {error.get('message')}")
