"""A training step dynamo splits, planned eagerly and compiled as planned (NOTE [graph breaks]).

Why it exists: `optimize(..., compile=True)` plans the one joint graph AOT autograd builds (compiled.py).
A step dynamo splits has no such graph; this module plans it the way that still keeps the budget.

NOTE [graph breaks]: where dynamo breaks the step's graph (data-dependent control flow, a call it
cannot trace), part of the step runs eagerly between compiled graphs, and where the break is inside a
module call dynamo may run the calling modules eagerly altogether (the zoo's untraceable_mlp compiles
only the gated Linear). No joint graph then describes the step, and planning one graph alone under the
whole budget would count none of the eager part. So `optimize` stops the compile at the first break
(`SplitStep`: a second graph reaches the backend, or dynamo counted a break) and plans the eager step
instead: the eager plan's `plan.module` is compiled as it is (checkpointed regions become inductor's
recompute inside the graphs, and stay eager checkpoints outside them), its compiled peak is measured,
and a measurement over the budget replans the eager step under the budget less the miss, as NOTE
[checked budget] does (`optimize_split`). Its compiled pieces are partitioned as eager autograd saves
(torch's `default_partition`, `EagerSaving`), not by inductor's min-cut, which chooses within its own
graph and cannot see what the eager code around it keeps alive: untraceable_mlp's gated Linear saved a
128 KiB ReLU mask beside the ReLU output that the next Linear (eager) keeps anyway, and its plans
measured up to 252 KiB above their prediction, so most were compiled twice. Saving as eager does, the
eager prediction holds for the compiled step (within 1 KiB on untraceable_mlp, at every budget in
tests/planner/test_compiled.py). A plan that checkpoints nothing compiles the model itself, not the
planned module: the planned graph calls the untraceable module as a leaf, dynamo compiled four pieces
of it where it compiles two of the model, and their backward allocated 1 KiB more (a bias gradient's
size) before the step's peak, so at a budget of the eager step's peak the first plan measured 1 KiB
over and the second checkpointed a region (bench/compare.py's three untraceable_mlp rows at 1.04x the
peer's time). Its predicted figures are the eager step's, and the summary says so;
the measured peak is the compiled step's. `plan_compiled_step` returns that eager plan. A log
call is the common break (Hugging Face's GPT-2 warns once from its loss) and needs none of this: while
`optimize` compiles, dynamo skips the `logging.Logger` methods (`ignore_logger_methods`), so the message
is not logged from the compiled step; a recompile later (another shape) runs under the caller's own
dynamo settings. Shapes are static (`dynamic=False`): a call with other shapes recompiles, and that
graph is planned on its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch._functorch import partitioners
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from planner.compiled_step import (
    MAX_ATTEMPTS,
    ExampleStep,
    checked_peak_bytes,
    compile_step,
    dynamo_settings,
    replanned_budget_bytes,
)
from planner.ir import TrainingStep
from planner.measurement import OptimizerSpec
from planner.plan import CompiledStep, Plan
from planner.profiling import Profile, profile

__all__ = ["EagerSaving", "SplitPlanning", "compiled_pieces", "eager_profile", "optimize_split", "splits"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitPlanning:
    """What a split step is planned for: the user's budget, the solver, and the step around it."""

    budget_bytes: int
    solver: str
    optimizer: OptimizerSpec
    step: TrainingStep


def splits(call: ExampleStep) -> bool:
    """Whether dynamo breaks the step's graph (its trace, without compiling: `torch._dynamo.explain`)."""
    from planner.graph_build import preserved_state

    with preserved_state(call.model), dynamo_settings():
        explanation = torch._dynamo.explain(call.model)(*call.inputs, **call.kwargs)
    return explanation.graph_break_count > 0 or explanation.graph_count > 1


def eager_profile(call: ExampleStep, optimizer: OptimizerSpec, step: TrainingStep) -> Profile:
    """The eager step profiled, as `optimize(..., compile=False)` profiles it (NOTE [graph breaks])."""
    return profile(
        call.model,
        call.inputs,
        example_kwargs=call.kwargs,
        optimizer=optimizer,
        step=step,
        loss_fn=call.loss_fn,
    )


def optimize_split(call: ExampleStep, planning: SplitPlanning, reasons: str, started_s: float) -> Plan:
    """NOTE [graph breaks]: the eager step planned, its plan compiled as it is and measured, and planned
    again below the budget less the miss while the measurement exceeds the budget."""
    log.warning("torch.compile breaks this step's graph (%s): planning the eager step", reasons)
    profiled = eager_profile(call, planning.optimizer, planning.step)
    planning_s = time.perf_counter() - started_s
    planned_bytes = planning.budget_bytes
    for attempt in range(1, MAX_ATTEMPTS + 1):
        solving_s = time.perf_counter()
        plan = profiled.plan(budget_bytes=planned_bytes, solver=planning.solver)
        planning_s += time.perf_counter() - solving_s
        assert plan.module is not None
        module = compiled_pieces(plan.module if plan.schedule.checkpointed else call.model, call)
        measured_bytes = checked_peak_bytes(plan, module, call)
        if measured_bytes is None or measured_bytes <= planning.budget_bytes or attempt == MAX_ATTEMPTS:
            break
        planned_bytes = replanned_budget_bytes(plan, planning.budget_bytes, planned_bytes, measured_bytes)
    plan.module = module
    plan.budget_bytes = planning.budget_bytes
    plan.compiled = CompiledStep(
        compile_s=time.perf_counter() - started_s,
        planning_s=planning_s,
        measured_peak_bytes=measured_bytes,
        planned_budget_bytes=planned_bytes,
        attempts=attempt,
        graph_breaks=reasons,
    )
    return plan


class EagerSaving(CustomPartitionerFn):
    """The partition of a split step's compiled pieces: each saves what eager autograd saves (torch's
    `default_partition`), so that the eager plan's prediction holds for them (NOTE [graph breaks])."""

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        return partitioners.default_partition(
            gm,
            joint_inputs,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
        )

    def uuid(self) -> Any:
        """One decision, the same for every graph: the FX-graph cache may hand it back."""
        return "planner.compiled:eager-saving"


def compiled_pieces(module: torch.nn.Module, call: ExampleStep) -> torch.nn.Module:
    """`module` compiled with inductor, its pieces partitioned as eager autograd saves (`EagerSaving`)
    and without inductor's buffer pool (NOTE [buffer pool]); the example step compiles it."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        patches = {"allow_buffer_reuse": False, "custom_partitioner_fn": EagerSaving()}
        return compile_fx(graph_module, example_inputs, config_patches=patches)

    compiled = cast(torch.nn.Module, torch.compile(module, backend=backend, dynamic=False))
    with dynamo_settings():
        compile_step(compiled, call)
    return compiled
