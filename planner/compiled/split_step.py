"""A training step dynamo splits, planned eagerly and compiled as planned (NOTE [graph breaks]).

Why it exists: `optimize(..., compile=True)` plans the one joint graph AOT autograd builds (optimize.py).
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
tests/planner/test_compiled_breaks.py). A plan that checkpoints nothing compiles the model itself, not the
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

NOTE [eager draws]: a checkpointed region that holds a whole split call runs eagerly when its module
is compiled (NOTE [checkpointed breaks] in rewrite/emit.py: dynamo cannot split a checkpoint at a graph
break, and such code is where it breaks). Eager dropout draws its mask from the generator, inductor's
from seeds it takes from the generator once per graph, so that region's masks differ from the
compiled step's, and so do all drawn after it. Tried on five residual MLP blocks of width 128 whose
third checks its output for NaN (batch 32 x 64, one-off script): at 0.1 and 0.3 of the range the plan
checkpointed that block's whole call, and its loss was 5819.75 against compiled no checkpointing's
5857.53, gradients 2.5 % apart (those of its own forward); at 0.5 and 0.7, with no such region, loss
and gradients were equal. So a split call that draws random numbers (profiling counts the seeded
operators each part dispatches, its own code's `F.dropout` included) is checkpointed whole only where
no plan without it fits the budget (`SplitProfile.plan`), and the summary names it either way. A
checkpoint of one child call stays in the graph dynamo compiles, with the compiled step's numbers.
The price is memory: that model's lowest peak without the whole call was 38.4 MB against 28.9 with
it, so budgets between the two get the whole call and its own masks.

NOTE [hand fallback]: a split step's plans are predicted for the eager step, and compiled they measure
otherwise, by up to a fifth in either direction, so the plan predicted lowest need not measure lowest.
On four residual convolution blocks with BatchNorm whose second checks for NaN (tests/planner/
test_compiled_breaks.py), the solvers' lowest plan (regions cutting across blocks) and every block in a
checkpoint of its own are both predicted at 1,853,440 bytes; compiled in a fresh process, the first
measured 2,188,288 and the second 1,928,192, and `checkpoint_wrapper` on every block, compiled by hand,
2,179,072. At 0.2 of the eager range (2,011,341 bytes) `optimize` refused the budget after its
compilations, naming a minimum the hand method beats, where a schedule a user writes by hand fits. So
before a split step's budget is refused, the schedules of the hand methods that can be written for its
graph (`hand_schedules` in report/hand_checkpoints.py: sqrt(n) segments, every block of each numbered
container; the calls of NOTE [eager draws] left whole) that were not compiled yet are compiled, lowest
predicted peak first, and the first that measures within the budget is the plan, its summary naming the
method. Where none does, `InfeasibleBudget` names the lowest peak predicted or measured. A refusal
costs up to that many compilations more; a budget that fits costs nothing more.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch._functorch import partitioners
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from planner.compiled.step import (
    MAX_ATTEMPTS,
    ExampleStep,
    checked_peak_bytes,
    compile_step,
    dynamo_settings,
    raise_if_over,
    replanned_budget_bytes,
)
from planner.errors import InfeasibleBudget
from planner.ir import GLUE_OP, ActivationGraph, BudgetKind, TrainingStep
from planner.planning.graph import plan_schedule
from planner.planning.model import Profile, profile
from planner.planning.plan import Plan
from planner.profiler.counting import current_counting
from planner.profiler.measurement import OptimizerSpec
from planner.report.hand_checkpoints import hand_schedules
from planner.solvers import lowest_peak
from planner.solvers.solved_plan import CompiledStep

__all__ = [
    "EagerSaving",
    "SplitPlanning",
    "SplitProfile",
    "compiled_pieces",
    "eager_draws",
    "eager_profile",
    "optimize_split",
    "splits",
]

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
    from planner.profiler.interpreter import preserved_state

    with preserved_state(call.model), dynamo_settings():
        explanation = torch._dynamo.explain(call.model)(*call.inputs, **call.kwargs)
    return explanation.graph_break_count > 0 or explanation.graph_count > 1


@dataclass(frozen=True)
class SplitProfile:
    """A split step's eager profile, and the split calls that a checkpoint would run eagerly while they
    draw random numbers (NOTE [eager draws]): `refused` is the profile whose plans checkpoint
    none of them whole."""

    profiled: Profile
    refused: Profile
    eager_draws: dict[str, str]
    """Split calls' node names -> their module paths."""

    def plan(self, *, budget_bytes: int, solver: str) -> Plan:
        """The least recompute with the compiled step's random numbers, or where no such plan fits the
        budget, the least recompute (NOTE [eager draws])."""
        allocated = BudgetKind.ALLOCATED  # compiled plans bound allocated bytes, measured on the step
        try:
            return self.refused.plan(budget_bytes=budget_bytes, solver=solver, budget_kind=allocated)
        except InfeasibleBudget:
            if not self.eager_draws:
                raise
            return self.profiled.plan(budget_bytes=budget_bytes, solver=solver, budget_kind=allocated)

    def checkpointed_draws(self, plan: Plan) -> tuple[str, ...]:
        """Module paths of the `eager_draws` calls that `plan` checkpoints whole."""
        return tuple(
            sorted(
                {
                    self.eager_draws[node.part_of]
                    for region in plan.schedule.checkpointed
                    for node in plan.graph.nodes[region.start : region.stop]
                    if node.op == GLUE_OP and node.part_of in self.eager_draws
                }
            )
        )


def eager_profile(call: ExampleStep, optimizer: OptimizerSpec, step: TrainingStep) -> SplitProfile:
    """The eager step profiled, as `optimize(..., compile=False)` profiles it (NOTE [graph breaks]), and
    the whole calls that would draw the eager step's random numbers (NOTE [eager draws])."""
    profiled = profile(
        call.model,
        call.inputs,
        example_kwargs=call.kwargs,
        optimizer=optimizer,
        step=step,
        loss_fn=call.loss_fn,
        memory_counting=current_counting(),
    )
    draws = eager_draws(profiled.graph)
    nodes = tuple(
        dataclasses.replace(node, checkpointable=False)
        if node.op == GLUE_OP and node.part_of in draws
        else node
        for node in profiled.graph.nodes
    )
    refused = dataclasses.replace(profiled, graph=dataclasses.replace(profiled.graph, nodes=nodes))
    return SplitProfile(profiled, refused, draws)


def eager_draws(graph: ActivationGraph) -> dict[str, str]:
    """Split calls (node names -> module paths) that draw random numbers: a checkpoint of one whole
    runs eagerly under torch.compile (NOTE [checkpointed breaks] in rewrite/emit.py)."""
    drawing = {node.part_of for node in graph.nodes if node.part_of and node.random}
    return {
        node.part_of: node.module_path
        for node in graph.nodes
        if node.op == GLUE_OP and node.part_of in drawing and node.checkpointable
    }


def optimize_split(call: ExampleStep, planning: SplitPlanning, reasons: str, started_s: float) -> Plan:
    """NOTE [graph breaks]: the eager step planned, its plan compiled as it is and measured, and planned
    again below the budget less the miss while the measurement exceeds the budget; where no plan fits,
    the hand methods' schedules are compiled before the budget is refused (NOTE [hand fallback])."""
    log.warning("torch.compile breaks this step's graph (%s): planning the eager step", reasons)
    profiled = eager_profile(call, planning.optimizer, planning.step)
    profiling_s = time.perf_counter() - started_s
    compilations = _Compilations(call, planning.budget_bytes)
    try:
        compiled, planned_bytes = _planned(profiled, planning, compilations)
        hand_method = ""
    except InfeasibleBudget as refusal:
        compiled = _hand_fallback(profiled.refused, compilations, refusal)
        planned_bytes, hand_method = planning.budget_bytes, compiled.plan.schedule.solver
    plan = compiled.plan
    plan.module = compiled.module
    plan.budget_bytes = planning.budget_bytes
    plan.compiled = CompiledStep(
        compile_s=time.perf_counter() - started_s,
        planning_s=profiling_s + sum(tried.solve_ms for tried in compilations.plans) / 1e3,
        measured_peak_bytes=compiled.measured_bytes,
        planned_budget_bytes=planned_bytes,
        attempts=len(compilations.plans),
        graph_breaks=reasons,
        eager_draw_calls=tuple(sorted(profiled.eager_draws.values())),
        checkpointed_draw_calls=profiled.checkpointed_draws(plan),
        hand_method=hand_method,
    )
    return plan


@dataclass(frozen=True)
class _Compiled:
    """A plan's module compiled, and the peak its example step measured (None where not measurable)."""

    plan: Plan
    module: torch.nn.Module
    measured_bytes: int | None


@dataclass
class _Compilations:
    """Every plan of one split step compiled so far, and what each measured (NOTE [checked budget])."""

    call: ExampleStep
    budget_bytes: int
    plans: list[Plan] = field(default_factory=list)
    measured_bytes: list[int] = field(default_factory=list)

    def compile(self, plan: Plan) -> _Compiled:
        """`plan`'s module compiled and measured; a plan that checkpoints nothing compiles the model
        itself (NOTE [graph breaks])."""
        assert plan.module is not None
        module = compiled_pieces(plan.module if plan.schedule.checkpointed else self.call.model, self.call)
        measured_bytes = checked_peak_bytes(plan, module, self.call)
        self.plans.append(plan)
        if measured_bytes is not None:
            self.measured_bytes.append(measured_bytes)
        return _Compiled(plan, module, measured_bytes)

    def fits(self, compiled: _Compiled) -> bool:
        return compiled.measured_bytes is None or compiled.measured_bytes <= self.budget_bytes


def _planned(
    profiled: SplitProfile, planning: SplitPlanning, compilations: _Compilations
) -> tuple[_Compiled, int]:
    """The solvers' plan that measured within the budget, and the budget it was planned under; raises
    `InfeasibleBudget` where none did in `MAX_ATTEMPTS` compilations (NOTE [checked budget])."""
    planned_bytes = planning.budget_bytes
    for attempt in range(1, MAX_ATTEMPTS + 1):
        compiled = compilations.compile(profiled.plan(budget_bytes=planned_bytes, solver=planning.solver))
        if compilations.fits(compiled) or attempt == MAX_ATTEMPTS:
            break
        assert compiled.measured_bytes is not None
        planned_bytes = replanned_budget_bytes(
            compiled.plan, planning.budget_bytes, planned_bytes, compiled.measured_bytes
        )
    raise_if_over(compiled.plan, planning.budget_bytes, compilations.measured_bytes)
    return compiled, planned_bytes


def _hand_fallback(profile: Profile, compilations: _Compilations, refusal: InfeasibleBudget) -> _Compiled:
    """NOTE [hand fallback]: the first hand method's schedule, by predicted peak, that measures within
    the budget compiled; else `InfeasibleBudget` naming the lowest peak predicted or measured."""
    tried = [plan.schedule.regions for plan in compilations.plans]
    min_peak_bytes = lowest_peak(profile.graph)[1].peak_bytes
    candidates = sorted(
        (
            plan_schedule(
                profile.graph, schedule, budget_bytes=compilations.budget_bytes, min_peak_bytes=min_peak_bytes
            )
            for schedule in hand_schedules(profile.graph).values()
            if schedule.regions not in tried
        ),
        key=lambda plan: plan.predicted_peak_bytes,
    )
    for plan in candidates:
        log.warning(
            "no plan of the solvers measured within the budget compiled; compiling the hand method '%s'",
            plan.schedule.solver,
        )
        compiled = compilations.compile(profile.apply(plan))
        if compilations.fits(compiled):
            return compiled
    raise InfeasibleBudget(
        budget_bytes=compilations.budget_bytes,
        min_peak_bytes=min([refusal.min_peak_bytes, *compilations.measured_bytes]),
        breakdown=refusal.breakdown,
    )


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
