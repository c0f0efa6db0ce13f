"""The plan's report (`Plan.summary()`), and why checkpointing cannot help when it cannot.

Why it exists: people who checkpoint by hand cannot tell *why* memory did not drop. A bare
"predicted peak" does not tell them; what does is which phase of the step sets the peak, what is alive
at that moment, and how much of it any checkpoint plan can touch. When the answer is "none of it"
(the optimizer step sets the peak, or the lowest achievable peak is the no-checkpointing peak), the
report says so with the numbers and estimates what the next levers would do (levers.py).

NOTE [lever estimates] (a lever's effect is estimated from the graph's bytes, not predicted) is in
levers.py, with the levers.

Everything here reads plain data (ir.py) and the torch-free simulator; it never imports torch.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from planner.errors import format_bytes
from planner.ir import (
    ActivationGraph,
    BudgetKind,
    Component,
    CostModel,
    MemoryCounting,
    Phase,
    Schedule,
    SimulationResult,
)
from planner.report.levers import (
    FORWARD_BACKWARD,
    OPTIMIZER_STEP,
    REPORT_WIDTH,
    estimate_levers,
    peak_components,
    render_levers,
)
from planner.report.naming import describe_region, display_module
from planner.simulation.replay import selective_overhead_ms
from planner.simulation.step import store_everything

if TYPE_CHECKING:
    from planner.solvers.solved_plan import CompiledStep, SolvedPlan

__all__ = [
    "CANNOT_HELP_FRACTION",
    "COMPONENT_LABELS",
    "cannot_help_reason",
    "describe_peak",
    "render_summary",
]

CANNOT_HELP_FRACTION = 0.05
"""Below this fraction of the no-checkpointing peak, the best plan's saving is not worth its recompute."""

COMPONENT_LABELS: dict[Component, str] = {component: component.label for component in Component}
"""Simulator breakdown keys, in report order, with the words the report uses."""

STATIC_COMPONENTS = tuple(component for component in Component if component.static)


def _eager_draw_rows(compiled: CompiledStep) -> list[str]:
    """Which whole calls of a split step a plan keeps from checkpointing, or checkpoints all the same
    (NOTE [eager draws] in compiled/split_step.py)."""
    checkpointed = compiled.checkpointed_draw_calls
    if checkpointed:
        return [
            f"  checkpointed whole although they draw random numbers: {', '.join(checkpointed)}; no plan",
            "  without them fits: their checkpoint runs eagerly and draws other numbers than compiled",
            "  no checkpointing (gradients are those of its own forward),",
        ]
    if compiled.eager_draw_calls:
        return [
            f"  not checkpointed whole: {', '.join(compiled.eager_draw_calls)} (they draw random numbers,",
            "  and a checkpoint of a call fx cannot trace runs eagerly, drawing other numbers than the",
            "  compiled step; plans that checkpoint them reach lower peaks, made where nothing else fits),",
        ]
    return []


def _python_draw_rows(graph: ActivationGraph) -> list[str]:
    """Which calls drew from Python's or NumPy's generator in the profiled step: their figures are the
    branch that step drew (NOTE [Python draws] in capture/kept_whole.py)."""
    drawn = (node.module_path or "the model's own forward" for node in graph.nodes if node.draws_python)
    drawing = list(dict.fromkeys(drawn))
    if not drawing:
        return []
    return [
        f"  drew from Python's or NumPy's random generator when profiled: {', '.join(drawing[:4])};",
        "  figures are for steps that draw as the profiled one did (another draw may run other code)",
    ]


def _source_rows(plan: SolvedPlan) -> list[str]:
    """Where the figures come from: a profiled eager step, or the compiled step's joint graph and the
    peak `optimize(..., compile=True)` measured."""
    compiled = plan.compiled
    if compiled is None:
        return [
            "  every figure is predicted by the simulator from one profiled step "
            f"({_timing_note(plan.graph.timing)});",
            "  measure plan.module with planner.measure for measured figures",
            *_python_draw_rows(plan.graph),
        ]
    if compiled.graph_breaks:
        rows = [
            f"  torch.compile breaks this step's graph ({compiled.graph_breaks}),",
            "  so part of it runs eagerly: the plan was made on the eager step and compiled as it is;",
            "  its compiled pieces save what eager autograd saves, so figures are predicted for the eager",
            f"  step ({_timing_note(plan.graph.timing)}),",
        ]
        rows += _eager_draw_rows(compiled)
        if compiled.hand_method:
            rows += [
                f"  the schedule of a hand method, {compiled.hand_method}: no plan of the solvers measured",
                "  within the budget compiled, and this one did,",
            ]
    else:
        rows = [
            "  figures are predicted by the simulator from the joint graph inductor partitions "
            f"({_timing_note(plan.graph.timing)}),",
        ]
    rows.append("  except the measured peak: the compiled forward and backward, run once by optimize")
    if compiled.measured_peak_bytes is not None:
        over = compiled.measured_peak_bytes - plan.budget_bytes
        rows.append(
            f"  {'measured peak (compiled step)':<32}{format_bytes(compiled.measured_peak_bytes):>12}  "
            + ("within the budget" if over <= 0 else f"OVER the budget by {format_bytes(over)}")
        )
    rows.append(
        f"  {'compile time':<32}{compiled.compile_s:>10.1f} s  (planning {compiled.planning_s:.1f} s of it; "
        f"{compiled.attempts} compilation{'s' if compiled.attempts > 1 else ''})"
    )
    if compiled.planned_budget_bytes < plan.budget_bytes:
        rows.append(
            f"  planned under {format_bytes(compiled.planned_budget_bytes)}: an earlier compilation measured "
            "above the budget"
        )
    return rows


def _timing_note(timing: str) -> str:
    if timing == CostModel.MEASURED:
        return "per-node times measured on the profiling machine"
    return f"per-node times {timing}: FLOPs and bytes on a roofline, not measured"


def _region_number(schedule: Schedule, index: int) -> int | None:
    """1-based number of the checkpointed region holding node `index`, if any."""
    for number, region in enumerate(schedule.checkpointed, start=1):
        if region.start <= index < region.stop:
            return number
    return None


def describe_peak(graph: ActivationGraph, schedule: Schedule, result: SimulationResult) -> str:
    """Which phase sets the peak, in words: forward, backward of region k (in which micro-batch, when
    gradients are alive), unscaling, clipping or the optimizer step."""
    if result.peak_phase.after_backward:
        return AFTER_BACKWARD_WORDS[result.peak_phase]
    micro_batch = f", {result.peak_micro_batch}" if result.peak_micro_batch else ""
    return _describe_forward_backward(graph, schedule, result) + micro_batch


AFTER_BACKWARD_WORDS = {
    Phase.UNSCALE: "GradScaler.unscale_ (parameters, gradients, optimizer state and its temporaries)",
    Phase.CLIP: "clip_grad_norm_ (parameters, gradients, optimizer state and the norms' temporaries)",
    Phase.OPTIMIZER: "the optimizer step (parameters, gradients, optimizer state and the step's temporaries)",
}
"""How `describe_peak` names a peak set after the last backward."""


def _describe_forward_backward(graph: ActivationGraph, schedule: Schedule, result: SimulationResult) -> str:
    index = graph.index_of(result.peak_node)
    node = graph.nodes[index]
    where = f"node {node.name}" + (f" in {display_module(node.module_path)}" if node.module_path else "")
    if result.peak_phase is Phase.FORWARD:
        return f"forward, at {where}"
    number = _region_number(schedule, index)
    if number is None:
        outside = ", outside any checkpointed region" if schedule.checkpointed else ""
        return f"backward, at {where}{outside}"
    if result.peak_phase is Phase.RECOMPUTE:
        return f"backward of checkpointed region {number}, while its forward is recomputed (at {where})"
    return f"backward of checkpointed region {number}, at {where}"


def cannot_help_reason(plan: SolvedPlan) -> str | None:
    """Why checkpointing cannot help this step, with the numbers; None when it can."""
    baseline = plan.baseline
    if baseline.peak_phase.after_backward:
        parts = peak_components(plan.graph, plan.schedule)
        step = parts[OPTIMIZER_STEP]
        labels = {**COMPONENT_LABELS, Component.WORKSPACE: "step temporaries"}
        listed = " + ".join(
            f"{label} {format_bytes(step[key])}" for key, label in labels.items() if step.get(key, 0)
        )
        forward_backward_bytes = sum(parts[FORWARD_BACKWARD].values())
        return (
            f"the optimizer step sets the peak ({format_bytes(baseline.peak_bytes)} = {listed}) and no "
            f"activation is alive then, so no checkpoint plan lowers it; forward and backward peak at "
            f"{format_bytes(forward_backward_bytes)} under this plan."
        )
    saving_bytes = plan.baseline_peak_bytes - plan.min_peak_bytes
    if saving_bytes < CANNOT_HELP_FRACTION * plan.baseline_peak_bytes:
        static_bytes = sum(baseline.breakdown.get(key, 0) for key in STATIC_COMPONENTS)
        return (
            f"the best plan lowers the peak by only {format_bytes(saving_bytes)} "
            f"({saving_bytes / plan.baseline_peak_bytes:.1%} of {format_bytes(plan.baseline_peak_bytes)}): "
            f"parameters, gradients, optimizer state and inputs are {format_bytes(static_bytes)} of it, "
            f"and the activations left are what the backward pass needs at once."
        )
    return None


def _breakdown_rows(plan: SolvedPlan) -> list[str]:
    planned, baseline = plan.simulation.breakdown, plan.baseline.breakdown
    rows = [f"  {'bytes at the peak (predicted)':<32}{'with plan':>12}{'no checkpointing':>18}"]
    for key, label in COMPONENT_LABELS.items():
        if planned.get(key, 0) or baseline.get(key, 0):
            rows.append(
                f"    {label:<30}{format_bytes(planned.get(key, 0)):>12}"
                f"{format_bytes(baseline.get(key, 0)):>18}"
            )
    rows.append(
        f"    {'total = peak':<30}{format_bytes(plan.predicted_peak_bytes):>12}"
        f"{format_bytes(plan.baseline_peak_bytes):>18}"
    )
    planned_parts = peak_components(plan.graph, plan.schedule)
    baseline_parts = peak_components(plan.graph, store_everything(plan.graph))
    for phase in planned_parts:
        rows.append(
            f"  {phase + ' peak':<32}{format_bytes(sum(planned_parts[phase].values())):>12}"
            f"{format_bytes(sum(baseline_parts[phase].values())):>18}"
        )
    return rows


def _region_rows(plan: SolvedPlan) -> list[str]:
    checkpointed = plan.schedule.checkpointed
    if not checkpointed:
        return ["  checkpointed regions: none (everything is stored, as without checkpointing)"]
    rows = [f"  checkpointed regions ({len(checkpointed)}, each recomputed once in backward):"]
    for number, region in enumerate(checkpointed, start=1):
        kept = f", {len(region.keep)} kept by a selective policy" if region.keep else ""
        rows.append(
            f"    {number}. {describe_region(plan.graph, region)}  ({region.stop - region.start} nodes{kept})"
        )
    return rows


def _selective_note(plan: SolvedPlan) -> str:
    """How much of the recompute is the selective policy's own cost, when any region keeps nodes."""
    policy_ms = sum(selective_overhead_ms(plan.graph, region) for region in plan.schedule.checkpointed)
    return f"; {policy_ms:.1f} ms of it the selective policy's callbacks" if policy_ms > 0 else ""


def _plan_space_note(plan: SolvedPlan) -> str:
    """How far the plan is from the least recompute over its plan space, and what that space is."""
    gap = plan.schedule.gap
    if gap != gap:  # NaN: the solver could not bound its answer
        quality = "least recompute not proven (a search bound was hit)"
    elif gap == 0:
        quality = "least recompute proven"
    else:
        quality = f"within {gap:.1%} of the least recompute"
    space = "regions start and end at module calls and cuts"
    if plan.schedule.solver != "ilp":
        space += "; no selective keeps (the ilp solver also searches those)"
    return f"{quality}; {space}"


def _reserved_rows(plan: SolvedPlan) -> list[str]:
    """What CUDA's caching allocator would reserve for the plan (simulation/reserved.py), for plans counted
    as a GPU counts; a plan for CPU training (exact bytes) has no caching allocator."""
    if plan.graph.memory_counting is not MemoryCounting.BLOCKS:
        return []
    reserved = plan.reserved
    verdict = "by CUDA's caching allocator"
    if plan.budget_kind is BudgetKind.RESERVED:
        verdict = _fits(plan.budget_bytes, reserved.reserved_peak_bytes)
    return [
        f"  {'predicted peak reserved':<32}{format_bytes(reserved.reserved_peak_bytes):>12}  {verdict} "
        f"(the allocator's allocated peak {format_bytes(reserved.allocated_peak_bytes)})",
        f"  {'  with expandable segments':<32}{format_bytes(reserved.expandable_reserved_peak_bytes):>12}  "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        *textwrap.wrap(plan.allocator_note, 104, initial_indent="  note: ", subsequent_indent="    "),
    ]


def _fits(budget_bytes: int, peak_bytes: int) -> str:
    spare_bytes = budget_bytes - peak_bytes
    return f"fits, {format_bytes(spare_bytes)} to spare" if spare_bytes >= 0 else "OVER the budget"


def _card_note(plan: SolvedPlan) -> str:
    """Where a budget taken from a card came from (NOTE [held back] in profiler/cost_model.py)."""
    if plan.card is None:
        return ""
    return (
        f"  {plan.card}'s memory less {format_bytes(plan.held_back_bytes)} held back for the CUDA context "
        "and cuBLAS workspaces"
    )


def render_summary(plan: SolvedPlan) -> str:
    """The plain-text report of `plan` (see the module docstring for what it answers)."""
    result, baseline = plan.simulation, plan.baseline
    saving_bytes = plan.baseline_peak_bytes - plan.predicted_peak_bytes
    reserved_kind = plan.budget_kind is BudgetKind.RESERVED
    lines = [
        f"checkpoint plan: {plan.solver} solver, {len(plan.graph.nodes)} nodes captured by {plan.capture}, "
        f"optimizer {plan.graph.optimizer}",
        *_source_rows(plan),
        f"  bytes are {plan.graph.memory_counting.words}",
        f"  {'budget':<32}{format_bytes(plan.budget_bytes):>12}{_card_note(plan)}",
        f"  {'the budget bounds':<32}{plan.budget_kind.words}",
        f"  {'predicted peak':<32}{format_bytes(plan.predicted_peak_bytes):>12}  "
        + ("allocated" if reserved_kind else _fits(plan.budget_bytes, plan.predicted_peak_bytes)),
        *_reserved_rows(plan),
        f"  {'predicted peak, no checkpointing':<32}{format_bytes(plan.baseline_peak_bytes):>12}",
        f"  {'lowest achievable peak':<32}{format_bytes(plan.min_peak_bytes):>12}  "
        + ("(predicted reserved, lowest allocated plan)" if reserved_kind else "(predicted, any plan)"),
        f"  {'plan space':<32}{_plan_space_note(plan)}",
        f"  {'predicted saving':<32}{format_bytes(saving_bytes):>12}  "
        f"({saving_bytes / plan.baseline_peak_bytes:.1%} of no checkpointing)",
        f"  {'predicted overhead':<32}{plan.predicted_overhead:>12.1%}  "
        f"(recompute {result.recompute_ms:.1f} ms of a {result.step_ms:.1f} ms step{_selective_note(plan)})",
        f"  peak set in: {describe_peak(plan.graph, plan.schedule, result)}",
        f"  without checkpointing: {describe_peak(plan.graph, store_everything(plan.graph), baseline)}",
        *_breakdown_rows(plan),
        *_region_rows(plan),
    ]
    reason = cannot_help_reason(plan)
    if reason is not None:
        components = peak_components(plan.graph, plan.schedule)
        lines += [
            *textwrap.wrap(
                f"checkpointing cannot help here: {reason}",
                width=REPORT_WIDTH,
                initial_indent="  ",
                subsequent_indent="    ",
            ),
            "  next levers (estimates from the graph's bytes, not predictions; "
            "see planner/report/levers.py):",
            *render_levers(
                estimate_levers(
                    components,
                    optimizer=plan.graph.optimizer,
                    gradient_bytes=plan.graph.static.accumulated_gradient_bytes,
                )
            ),
        ]
    return "\n".join(lines)
