"""The compiled step's example call: compiled once, run, and its peak measured (optimize.py).

Why it exists: planning the compiled step (optimize.py) and planning a step dynamo splits (NOTE [graph
breaks] in split_step.py) both compile the model, run one forward and backward on the example
inputs to do so, and count the peak of that run against the budget (NOTE [checked budget]). This
module holds that shared part: the example call, dynamo's settings while `optimize` compiles, the run
that compiles and stops early where a partitioner asks it to, the measurement, and the lower budget
a plan measured over its budget is planned again under.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from planner.errors import InfeasibleBudget, PlannerError, format_bytes
from planner.planning.plan import Plan
from planner.profiler.counting import AllocatorPhases, tensors_in
from planner.profiler.measurement import end_autocast_forward

log = logging.getLogger(__name__)

__all__ = [
    "DYNAMO_LIMITS",
    "LOG_METHODS",
    "MAX_ATTEMPTS",
    "ExampleStep",
    "PlanOnly",
    "SplitStep",
    "caused_by",
    "checked_peak_bytes",
    "compile_step",
    "dynamo_settings",
    "graph_breaks",
    "log_methods",
    "lowered_budget_bytes",
    "planner_cause",
    "raise_if_over",
    "replanned_budget_bytes",
    "split_text",
]


class PlanOnly(Exception):
    """Raised by a `plan_only` partitioner once it has planned, to stop the compile there."""


class SplitStep(Exception):
    """Raised where dynamo breaks the step's graph, to stop the compile there (NOTE [graph breaks])."""

    def __init__(self, reasons: str) -> None:
        super().__init__(reasons)
        self.reasons = reasons


def graph_breaks() -> Counter[str]:
    """Graph breaks dynamo has counted in this process, by the first line of their reason."""
    from torch._dynamo.utils import counters

    found: Counter[str] = Counter()
    for reason, count in counters["graph_break"].items():
        found[str(reason).splitlines()[0]] += count
    return found


def split_text(reasons: Iterable[str]) -> str:
    return "; ".join(sorted(set(reasons))) or "dynamo compiled the step as more than one graph"


DYNAMO_LIMITS = {"recompile_limit": 2**10, "accumulated_recompile_limit": 2**16}
"""Each planning compiles the model afresh (a backend of its own), which dynamo counts as a recompile
of the model's code; planning the same model class many times must not hit its limits and fall back
to eager, which would leave the plan uninstalled."""
LOG_METHODS = ("debug", "info", "warning", "warning_once", "error")
"""`logging.Logger` methods dynamo skips while `optimize` compiles (NOTE [graph breaks]); transformers
adds `warning_once` to the class when it is imported."""


def log_methods() -> set[Callable[..., Any]]:
    """The `LOG_METHODS` that `logging.Logger` has now, for `ignore_logger_methods`."""
    return {method for name in LOG_METHODS if (method := getattr(logging.Logger, name, None)) is not None}


@contextlib.contextmanager
def dynamo_settings() -> Iterator[None]:
    """DYNAMO_LIMITS, and log calls skipped rather than splitting the graph (NOTE [graph breaks])."""
    ignored = set(torch._dynamo.config.ignore_logger_methods) | log_methods()
    with torch._dynamo.config.patch({**DYNAMO_LIMITS, "ignore_logger_methods": ignored}):
        yield


@dataclass(frozen=True)
class ExampleStep:
    """The example call and what its backward differentiates."""

    model: torch.nn.Module
    inputs: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]
    targets: list[torch.Tensor]

    def run(self, module: torch.nn.Module, on_phase: Callable[[str], None] = lambda phase: None) -> None:
        """One forward and backward through `module`; gradients go to `torch.autograd.grad`."""
        loss = self.loss_fn(module(*self.inputs, **self.kwargs))
        end_autocast_forward()
        on_phase("forward")
        torch.autograd.grad(loss, self.targets, allow_unused=True)
        del loss
        on_phase("backward")


def checked_peak_bytes(plan: Plan, module: torch.nn.Module, call: ExampleStep) -> int | None:
    """NOTE [checked budget]: the measured forward/backward peak with the step's resident state, or the
    predicted peak after backward where higher; None on a device this cannot measure."""
    from planner.profiler.interpreter import preserved_state

    static = plan.graph.static
    device = call.targets[0].device
    with preserved_state(call.model):
        if device.type == "cpu":
            resident = [*call.model.parameters(), *call.model.buffers()]
            resident += tensors_in((call.inputs, call.kwargs))
            with AllocatorPhases(resident, plan.graph.memory_counting) as allocator:
                call.run(module, allocator.on_phase)
            # NOTE [loop orders]: gradients alive through the forward alone count in its phase only
            forward_bytes = allocator.peaks.get("forward", 0) + static.forward_gradient_bytes
            measured_bytes = max(forward_bytes, *allocator.peaks.values())
            measured_bytes += static.optimizer_state_bytes + static.resident_gradient_bytes
        elif device.type == "cuda":
            torch.cuda.synchronize(device)
            before_bytes = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            call.run(module)
            torch.cuda.synchronize(device)
            measured_bytes = torch.cuda.max_memory_allocated(device) - before_bytes + static.resident_bytes
            measured_bytes += static.forward_gradient_bytes  # NOTE [loop orders]: an upper bound here
        else:
            return None
    after_backward = [step.live_bytes for step in plan.simulation.trace if step.phase.after_backward]
    return max([measured_bytes, *after_backward])


def compile_step(module: torch.nn.Module, call: ExampleStep) -> None:
    """One forward and backward through `module`, which compiles both graphs; RNG state and buffers
    are restored and no `.grad` is written, so the model is left as it was. A planner error raised
    inside the compiler (an infeasible budget) is raised as itself."""
    from planner.profiler.interpreter import preserved_state

    try:
        with preserved_state(call.model):
            call.run(module)
    except Exception as error:
        if caused_by(error, PlanOnly):
            return
        split = caused_by(error, SplitStep)
        if isinstance(split, SplitStep):
            raise split from None
        cause = planner_cause(error)
        if cause is not None:
            raise cause from None
        raise


def planner_cause(error: BaseException) -> PlannerError | None:
    """The planner error at the root of an exception the compiler wrapped, if there is one."""
    cause = caused_by(error, PlannerError)
    return cause if isinstance(cause, PlannerError) else None


def caused_by(error: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The exception of `kind` in the chain of `error` (the compiler wraps what a backend raises)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


MAX_ATTEMPTS = 3
"""Compilations `optimize_compiled` makes at most (NOTE [checked budget])."""


def replanned_budget_bytes(plan: Plan, budget_bytes: int, planned_bytes: int, measured_bytes: int) -> int:
    """The budget to plan under next after `plan`, planned under `planned_bytes`, measured
    `measured_bytes` over the user's `budget_bytes` (NOTE [checked budget]); `InfeasibleBudget` where
    that is no lower, with the measurement as the lowest peak."""
    lowered_bytes = lowered_budget_bytes(
        budget_bytes=budget_bytes,
        predicted_bytes=plan.predicted_peak_bytes,
        measured_bytes=measured_bytes,
        min_peak_bytes=plan.min_peak_bytes,
    )
    if lowered_bytes >= planned_bytes:
        raise InfeasibleBudget(
            budget_bytes=budget_bytes, min_peak_bytes=measured_bytes, breakdown=plan.simulation.breakdown
        )
    log.warning(
        "compiled plan measured %s over its budget of %s (predicted %s); planning again under %s",
        format_bytes(measured_bytes - budget_bytes),
        format_bytes(budget_bytes),
        format_bytes(plan.predicted_peak_bytes),
        format_bytes(lowered_bytes),
    )
    return lowered_bytes


def raise_if_over(plan: Plan, budget_bytes: int, measured_bytes: list[int]) -> None:
    """NOTE [checked budget]: `InfeasibleBudget` where the last of the `measured_bytes` (one per
    compilation, `plan` the last's) is still over the budget; the lowest of them is a peak a plan
    reached, so it is the lowest the error can name."""
    if measured_bytes and measured_bytes[-1] > budget_bytes:
        raise InfeasibleBudget(
            budget_bytes=budget_bytes, min_peak_bytes=min(measured_bytes), breakdown=plan.simulation.breakdown
        )


def lowered_budget_bytes(
    *, budget_bytes: int, predicted_bytes: int, measured_bytes: int, min_peak_bytes: int
) -> int:
    """The budget to plan under after a compiled plan predicted at `predicted_bytes` measured
    `measured_bytes`, over `budget_bytes` (NOTE [checked budget]).

    The model missed `measured_bytes - predicted_bytes`; a plan predicted within the budget less that
    miss measures within the budget where the miss stays the same. (Lowering the planned budget by the
    excess alone lets the solver pick the same schedule again where it had bytes to spare: a BERT plan
    predicted at 4.15 MiB under 4.18 MiB measured 4.53 MiB, 5.4 KiB over its 4.52 MiB budget, twice.)
    Since a plan is predicted within its planned budget, this is never above the planned budget less the
    excess. Never below the lowest peak.
    """
    return max(min_peak_bytes, budget_bytes - (measured_bytes - predicted_bytes))
