"""The plan's report (`Plan.summary()`) and the levers to pull when checkpointing cannot help.

Why it exists: people who checkpoint by hand cannot tell *why* memory did not drop. A bare
"predicted peak" does not tell them; what does is which phase of the step sets the peak, what is alive
at that moment, and how much of it any checkpoint plan can touch. When the answer is "none of it"
(the optimizer step sets the peak, or the lowest achievable peak is the no-checkpointing peak), the
report says so with the numbers and estimates what the next levers would do.

NOTE [lever estimates]: a lever's effect is *estimated*, not predicted: the graph was profiled with
one dtype, one optimizer, one device and one batch size, so the report scales the components of the
two candidate peaks (forward/backward and the optimizer step) by a factor per lever and takes the
larger peak. The factors and their assumptions are in `LEVER_RULES`; each printed line repeats its
assumption and says "estimate".

Everything here reads plain data (ir.py) and the torch-free simulator; it never imports torch.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import format_bytes
from planner.ir import (
    NO_OPTIMIZER,
    ActivationGraph,
    BudgetKind,
    Component,
    CostModel,
    MemoryCounting,
    OptimizerName,
    Phase,
    Schedule,
    SimulationResult,
)
from planner.report.naming import describe_region, display_module
from planner.simulation.step import selective_overhead_ms, simulate, store_everything
from planner.solvers import lowest_peak

if TYPE_CHECKING:
    from planner.solvers.solved_plan import CompiledStep, SolvedPlan

__all__ = [
    "CANNOT_HELP_FRACTION",
    "COMPONENT_LABELS",
    "FORWARD_BACKWARD",
    "LEVER_RULES",
    "OPTIMIZER_STEP",
    "Lever",
    "LeverRule",
    "cannot_help_reason",
    "compare_plans",
    "describe_peak",
    "estimate_levers",
    "levers_at_lowest_peak",
    "peak_components",
    "render_levers",
    "render_summary",
]

CANNOT_HELP_FRACTION = 0.05
"""Below this fraction of the no-checkpointing peak, the best plan's saving is not worth its recompute."""

FORWARD_BACKWARD = "forward/backward"
OPTIMIZER_STEP = "optimizer step"

COMPONENT_LABELS: dict[Component, str] = {component: component.label for component in Component}
"""Simulator breakdown keys, in report order, with the words the report uses."""

REPORT_WIDTH = 104
"""Prose lines of the report wrap here, so it reads in a terminal and in a README code block."""

STATIC_COMPONENTS = tuple(component for component in Component if component.static)


@dataclass(frozen=True)
class LeverRule:
    """A way to lower the peak other than checkpointing, as factors on the peak's components.

    `forward_backward` and `optimizer_step` map component names to the factor the lever applies in
    that phase; components not named keep their size. See NOTE [lever estimates].
    """

    name: str
    assumption: str
    forward_backward: Mapping[Component, float]
    optimizer_step: Mapping[Component, float]
    optimizers: tuple[str, ...] = ()
    """Optimizer names (lower case prefixes) the lever applies to; empty means any."""
    keeps_gradients: bool = False
    """The lever keeps every parameter's gradient alive through forward and backward (accumulation):
    the forward/backward peak then holds all of them (NOTE [accumulated gradients] in
    simulation/micro_batches.py)."""


SHARDING_DEVICES = 2
"""Devices in the sharding estimate: the smallest setup that shards, and the easiest to scale from."""

LEVER_RULES: tuple[LeverRule, ...] = (
    LeverRule(
        name="bf16 autocast",
        assumption="saved activations halve (matmul/conv inputs kept in bf16); fp32 weights, "
        "gradients and optimizer state unchanged",
        forward_backward={Component.ACTIVATIONS: 0.5, Component.RECOMPUTE: 0.5},
        optimizer_step={},
    ),
    LeverRule(
        name="8-bit Adam (e.g. bitsandbytes)",
        assumption="two 1-byte states per parameter instead of two fp32",
        forward_backward={Component.OPTIMIZER_STATE: 0.25},
        optimizer_step={Component.OPTIMIZER_STATE: 0.25},
        optimizers=(OptimizerName.ADAM,),
    ),
    LeverRule(
        name="SGD with momentum",
        assumption="one fp32 state per parameter instead of two",
        forward_backward={Component.OPTIMIZER_STATE: 0.5},
        optimizer_step={Component.OPTIMIZER_STATE: 0.5},
        optimizers=(OptimizerName.ADAM,),
    ),
    LeverRule(
        name="SGD without momentum",
        assumption="no optimizer state",
        forward_backward={Component.OPTIMIZER_STATE: 0.0},
        optimizer_step={Component.OPTIMIZER_STATE: 0.0},
        optimizers=(OptimizerName.SGD_MOMENTUM,),
    ),
    LeverRule(
        name=f"sharding over {SHARDING_DEVICES} devices (FSDP/ZeRO-3)",
        assumption=f"parameters, gradients, optimizer state and its step split {SHARDING_DEVICES} ways; "
        "ignores the gathered layer's transient",
        forward_backward=dict.fromkeys(
            (Component.PARAMETERS, Component.GRADIENTS, Component.OPTIMIZER_STATE), 1 / SHARDING_DEVICES
        ),
        optimizer_step=dict.fromkeys(
            (Component.PARAMETERS, Component.GRADIENTS, Component.OPTIMIZER_STATE, Component.WORKSPACE),
            1 / SHARDING_DEVICES,
        ),
    ),
    LeverRule(
        name="half the batch (2 accumulation steps)",
        assumption="inputs, activations and their temporaries scale with the batch; every gradient is "
        "alive from the second micro-batch on",
        forward_backward=dict.fromkeys(
            (Component.INPUTS, Component.ACTIVATIONS, Component.RECOMPUTE, Component.WORKSPACE), 0.5
        ),
        optimizer_step={Component.INPUTS: 0.5},
        keeps_gradients=True,
    ),
)


@dataclass(frozen=True)
class Lever:
    """The estimated peak if one lever were pulled (see NOTE [lever estimates])."""

    name: str
    estimated_peak_bytes: int
    saving_bytes: int
    assumption: str


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


def _source_rows(plan: SolvedPlan) -> list[str]:
    """Where the figures come from: a profiled eager step, or the compiled step's joint graph and the
    peak `optimize(..., compile=True)` measured."""
    compiled = plan.compiled
    if compiled is None:
        return [
            "  every figure is predicted by the simulator from one profiled step "
            f"({_timing_note(plan.graph.timing)});",
            "  measure plan.module with planner.measure for measured figures",
        ]
    if compiled.graph_breaks:
        rows = [
            f"  torch.compile breaks this step's graph ({compiled.graph_breaks}),",
            "  so part of it runs eagerly: the plan was made on the eager step and compiled as it is;",
            "  its compiled pieces save what eager autograd saves, so figures are predicted for the eager",
            f"  step ({_timing_note(plan.graph.timing)}),",
        ]
        rows += _eager_draw_rows(compiled)
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


def peak_components(graph: ActivationGraph, schedule: Schedule) -> dict[str, dict[Component, int]]:
    """Bytes by component at the forward/backward peak and at the optimizer step, under `schedule`."""
    # Only forward and backward: no optimizer step, and no unscaling or clipping after backward.
    forward_backward_only = dataclasses.replace(graph.step, max_grad_norm=None, grad_scaler=False)
    without_step = simulate(
        dataclasses.replace(graph, optimizer=NO_OPTIMIZER, step=forward_backward_only), schedule
    )
    components = {FORWARD_BACKWARD: dict(without_step.breakdown)}
    if graph.optimizer != NO_OPTIMIZER:
        static = graph.static
        components[OPTIMIZER_STEP] = {
            Component.PARAMETERS: static.parameter_bytes,
            Component.BUFFERS: static.buffer_bytes,
            Component.INPUTS: static.input_bytes,
            Component.OPTIMIZER_STATE: static.optimizer_state_bytes,
            Component.GRADIENTS: static.gradient_bytes,
            Component.WORKSPACE: static.optimizer_step_workspace_bytes,
        }
    return components


def _applies(rule: LeverRule, optimizer: str) -> bool:
    return not rule.optimizers or any(optimizer.lower().startswith(name) for name in rule.optimizers)


def estimate_levers(
    components: Mapping[str, Mapping[Component, int]], *, optimizer: str, gradient_bytes: int = 0
) -> list[Lever]:
    """Each applicable lever's estimated peak, from the components of each candidate peak.

    `components` maps a phase (`FORWARD_BACKWARD`, `OPTIMIZER_STEP`, or any single peak's name) to its
    bytes by component; a phase other than the optimizer step is scaled with the forward/backward
    factors. `gradient_bytes` (every parameter's gradient) is what a lever that keeps gradients
    alive puts in such a phase. Levers that would not lower the peak are kept: "bf16 does nothing
    here" is an answer.
    """
    current_bytes = max(sum(parts.values()) for parts in components.values())
    levers = []
    for rule in LEVER_RULES:
        if not _applies(rule, optimizer):
            continue
        estimated_bytes = 0
        for phase, parts in components.items():
            factors = rule.optimizer_step if phase == OPTIMIZER_STEP else rule.forward_backward
            if rule.keeps_gradients and phase != OPTIMIZER_STEP:
                parts = {**parts, Component.GRADIENTS: max(parts.get(Component.GRADIENTS, 0), gradient_bytes)}
            scaled = sum(round(size * factors.get(key, 1.0)) for key, size in parts.items())
            estimated_bytes = max(estimated_bytes, scaled)
        levers.append(
            Lever(
                name=rule.name,
                estimated_peak_bytes=estimated_bytes,
                saving_bytes=current_bytes - estimated_bytes,
                assumption=rule.assumption,
            )
        )
    return levers


def levers_at_lowest_peak(graph: ActivationGraph) -> list[Lever]:
    """The levers' estimates on top of the lowest-peak plan: what to try when no plan fits."""
    schedule, _ = lowest_peak(graph)
    return estimate_levers(
        peak_components(graph, schedule),
        optimizer=graph.optimizer,
        gradient_bytes=graph.static.accumulated_gradient_bytes,
    )


def render_levers(levers: list[Lever], indent: str = "    ") -> list[str]:
    """Two lines per lever: estimated peak and saving, then the assumption behind the estimate."""
    width = max((len(lever.name) for lever in levers), default=0)
    lines = []
    for lever in levers:
        lines += [
            f"{indent}{lever.name:<{width}}  ~{format_bytes(lever.estimated_peak_bytes):>11}  "
            f"(estimate, -{format_bytes(lever.saving_bytes)})",
            *textwrap.wrap(
                f"assumes {lever.assumption}",
                width=REPORT_WIDTH,
                initial_indent=f"{indent}  ",
                subsequent_indent=f"{indent}  ",
            ),
        ]
    return lines


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
            "see planner/report/summary.py):",
            *render_levers(
                estimate_levers(
                    components,
                    optimizer=plan.graph.optimizer,
                    gradient_bytes=plan.graph.static.accumulated_gradient_bytes,
                )
            ),
        ]
    return "\n".join(lines)


COMPARED_DEPTH = 2
"""Module paths are compared at this depth ("blocks.3"): deep enough to name a block, shallow enough
that an eager region over a whole block and compiled regions over its parts meet."""


def _module_key(path: str) -> str:
    return ".".join(path.split(".")[:COMPARED_DEPTH]) if path else "(model)"


def _kept_by_module(graph: ActivationGraph) -> dict[str, int]:
    """Activation bytes each module keeps for backward without checkpointing (a storage counts once,
    for the first module that saves it)."""
    kept: dict[str, int] = {}
    counted: set[str] = set()
    for node in graph.nodes:
        fresh = [name for name in node.saves if name not in counted]
        counted.update(fresh)
        key = _module_key(node.module_path)
        kept[key] = kept.get(key, 0) + sum(graph.storage_bytes[name] for name in fresh)
    return kept


def _recomputed_modules(plan: SolvedPlan) -> set[str]:
    return {
        _module_key(node.module_path)
        for region in plan.schedule.checkpointed
        for index, node in enumerate(plan.graph.nodes[region.start : region.stop], start=region.start)
        if index not in region.keep and node.forward_ms > 0
    }


def compare_plans(compiled: SolvedPlan, eager: SolvedPlan) -> str:
    """Where a plan for the compiled step and a plan for the eager step of the same model differ, and
    why, from their graphs (all figures predicted; see `Plan.compare`)."""
    kept = {"eager": _kept_by_module(eager.graph), "compiled": _kept_by_module(compiled.graph)}
    totals = {mode: sum(by_module.values()) for mode, by_module in kept.items()}
    recomputed = {"eager": _recomputed_modules(eager), "compiled": _recomputed_modules(compiled)}
    lines = [
        f"compiled plan vs eager plan (predicted figures; module paths at depth {COMPARED_DEPTH}):",
        f"  {'':<34}{'eager':>14}{'compiled':>14}",
    ]
    for label, of in (
        ("budget", lambda plan: format_bytes(plan.budget_bytes)),
        ("peak, no checkpointing", lambda plan: format_bytes(plan.baseline_peak_bytes)),
        ("lowest achievable peak", lambda plan: format_bytes(plan.min_peak_bytes)),
        ("peak of the plan", lambda plan: format_bytes(plan.predicted_peak_bytes)),
        ("recompute / step time", lambda plan: f"{plan.predicted_overhead:.1%}"),
        ("  per-node times", lambda plan: plan.graph.timing.split(" ")[0]),
    ):
        lines.append(f"  {label:<34}{of(eager):>14}{of(compiled):>14}")
    lines += [
        f"  {'activations kept, no checkpointing':<34}"
        f"{format_bytes(totals['eager']):>14}{format_bytes(totals['compiled']):>14}",
        f"  {'modules recomputed':<34}{len(recomputed['eager']):>14}{len(recomputed['compiled']):>14}",
    ]
    why = _kept_difference(totals["eager"], totals["compiled"])
    for mode, other in (("eager", "compiled"), ("compiled", "eager")):
        only = sorted(recomputed[mode] - recomputed[other])
        if not only:
            continue
        listed = ", ".join(display_module(name) for name in only[:8])
        more = f" and {len(only) - 8} more" if len(only) > 8 else ""
        lines.append(f"  recomputed only {mode}: {listed}{more}")
        why += [
            f"{display_module(name)} keeps {format_bytes(kept['eager'].get(name, 0))} eager and "
            f"{format_bytes(kept['compiled'].get(name, 0))} compiled without checkpointing"
            for name in only[:3]
            if kept["eager"].get(name, 0) != kept["compiled"].get(name, 0)
        ]
    keeps = sum(len(region.keep) for region in compiled.schedule.checkpointed)
    if keeps:
        why.append(
            f"the compiled plan saves {keeps} values inside recomputed regions: compiled, such a keep costs "
            "no per-operator callback (eager selective checkpointing does), so it pays wherever it saves time"
        )
    text = "why: " + "; ".join(why) + "." if why else "why: both steps keep the same bytes per module."
    lines += textwrap.wrap(text, width=REPORT_WIDTH, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


def _kept_difference(eager_bytes: int, compiled_bytes: int) -> list[str]:
    """Why the two steps' plans start from different places, in words (empty when they do not)."""
    if compiled_bytes < eager_bytes:
        return [
            f"inductor keeps {format_bytes(eager_bytes - compiled_bytes)} less for backward than eager "
            "autograd without any checkpointing: it recomputes cheap pointwise operators inside its "
            "backward kernels and never stores what it fuses, so the compiled step needs less "
            "checkpointing for a budget"
        ]
    if compiled_bytes > eager_bytes:
        return [
            f"inductor keeps {format_bytes(compiled_bytes - eager_bytes)} more for backward than eager "
            "autograd (copies made for its kernels, such as channels-last weights, and values stored between "
            "kernels), so the compiled step needs more checkpointing for a budget"
        ]
    return []
