"""A plan for the compiled step beside a plan for the eager step of the same model: where they differ,
and why (`Plan.compare`).

Why it exists: the compiled step keeps other bytes for backward than the eager one (inductor recomputes
and fuses what eager autograd stores), so the same budget gets other plans; the comparison says where
and why, module by module. It is a report of its own, apart from one plan's summary (split from
summary.py, issue 36).

Everything here reads plain data (ir.py); it never imports torch.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from planner.errors import format_bytes
from planner.ir import ActivationGraph
from planner.report.levers import REPORT_WIDTH
from planner.report.naming import display_module

if TYPE_CHECKING:
    from planner.solvers.solved_plan import SolvedPlan

__all__ = ["compare_plans"]


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
