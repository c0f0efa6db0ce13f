"""A plan as code someone can apply by hand: Hugging Face kwargs and a plain `torch.utils.checkpoint` snippet.

Why it exists: not everyone can ship `plan.module` (a rewritten module); some train a Hugging Face
model whose own `gradient_checkpointing_enable` is the only switch they may touch, others want the
plan in their own forward, reviewed like any other code. Both exports are derived from the plan's
regions in the model's module names (see planner/report/naming.py), and both refuse, with the reason, what
they cannot express instead of emitting something that is not the plan.

Torch-free: the snippet is text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planner.errors import format_bytes
from planner.ir import ActivationGraph, Region
from planner.report.blocks import block_number, block_numbers
from planner.report.naming import (
    describe_region,
    display_module,
    is_module_aligned,
    module_cover,
    python_path,
    sibling_run,
)

if TYPE_CHECKING:
    from planner.solvers.solved_plan import SolvedPlan

__all__ = ["hf_kwargs", "per_block_container", "region_call", "torch_snippet"]


def per_block_container(plan: SolvedPlan) -> str | None:
    """The container whose every block the plan checkpoints on its own (and nothing else), if any."""
    graph, regions = plan.graph, plan.schedule.checkpointed
    runs = [sibling_run(module_cover(graph, region)) for region in regions]
    single_blocks = [run for run in runs if run is not None and run.first == run.last]
    parents = {run.parent for run in single_blocks}
    if not regions or len(single_blocks) != len(regions) or len(parents) != 1:
        return None
    parent = parents.pop()
    if {run.first for run in single_blocks} != block_numbers(graph, parent):
        return None
    return parent if all(is_module_aligned(graph, region) for region in regions) else None


def hf_kwargs(plan: SolvedPlan) -> dict[str, Any]:
    """Keyword arguments for a Hugging Face model's `gradient_checkpointing_enable`, when they equal the plan.

    Hugging Face checkpoints every layer of the model's layer list, each on its own. That is this plan
    only when the plan checkpoints exactly one region per block of one numbered container, every
    block of it. Otherwise a ValueError says what the plan does instead.
    """
    graph, regions = plan.graph, plan.schedule.checkpointed
    if not regions:
        raise ValueError(
            "the plan checkpoints nothing: do not call gradient_checkpointing_enable (the model fits "
            f"the budget of {format_bytes(plan.budget_bytes)} as it is)"
        )
    if per_block_container(plan) is not None:
        return {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    described = "; ".join(describe_region(graph, region) for region in regions)
    raise ValueError(
        "gradient_checkpointing_enable checkpoints every layer on its own, but this plan checkpoints "
        f"{len(regions)} region(s): {described}. Apply it with plan.module, or by hand with "
        "plan.to_torch_snippet()."
    )


def region_call(graph: ActivationGraph, region: Region) -> str | None:
    """The `checkpoint(...)` call that runs `region`, when module calls alone reproduce it."""
    if not is_module_aligned(graph, region):
        return None
    cover = module_cover(graph, region)
    run = sibling_run(cover)
    if run is not None and run.last > run.first:
        modules = f"torch.nn.Sequential(*{python_path(run.parent)}[{run.first}:{run.last + 1}])"
        return f"x = checkpoint({modules}, x, use_reentrant=False)"
    if len(cover) == 1:
        return f"x = checkpoint({python_path(cover[0])}, x, use_reentrant=False)"
    return None


def _common_parent(paths: tuple[str, ...]) -> str:
    """The innermost module that contains every path (`""` for the model itself)."""
    split = [path.split(".") for path in paths]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    if len(paths) == 1:
        common = common[:-1]
    return ".".join(common)


def _where(graph: ActivationGraph, region: Region) -> str:
    """Whose forward holds the region's code, in words."""
    cover = module_cover(graph, region)
    parent = _common_parent(cover) if cover else ""
    prefix = f"{parent}." if parent else ""
    children = list(dict.fromkeys(path.removeprefix(prefix).split(".")[0] for path in cover))
    if len(children) > 1 and all(child.isdigit() for child in children):
        first, last = (display_module(prefix + child) for child in (children[0], children[-1]))
        return f"it spans {first} .. {last} without being whole modules"
    return f"in the forward of {display_module(parent)}"


def _region_lines(graph: ActivationGraph, number: int, region: Region) -> list[str]:
    nodes = graph.nodes[region.start : region.stop]
    count = f"{len(nodes)} graph node{'s' * (len(nodes) > 1)}"
    lines = [f"# region {number}: {describe_region(graph, region)} ({count})"]
    if any(node.stateful for node in nodes):
        lines.append(
            "# NOTE: holds BatchNorm-like state; plain checkpoint updates running statistics twice "
            "(plan.module does not)"
        )
    if region.keep:
        kept = ", ".join(graph.nodes[index].name for index in region.keep)
        lines += [
            f"# NOTE: the plan keeps the outputs of {kept} (a selective checkpoint policy); plain",
            "# checkpoint recomputes them too: more recompute, and a larger replay than predicted",
            "# (torch.utils.checkpoint.create_selective_checkpoint_contexts can keep them; plan.module does)",
        ]
    call = region_call(graph, region)
    if call is not None:
        return [*lines, call]
    return [
        *lines,
        f"# not one module call ({_where(graph, region)}):",
        f"# move the code from graph node {nodes[0].name} to {nodes[-1].name} into a function",
        f"def region_{number}(x):",
        f"    ...  # {', '.join(module_cover(graph, region)) or 'functional ops'}",
        "    return x",
        f"x = checkpoint(region_{number}, x, use_reentrant=False)",
    ]


def _is_root_sequential(graph: ActivationGraph) -> bool:
    """True when the model runs its numbered children in order and nothing else (an nn.Sequential).

    Nodes without a module may only follow the last module node: they are the loss, outside the model.
    """
    seen_functional = False
    for node in graph.nodes:
        if not node.module_path:
            seen_functional = True
        elif seen_functional or block_number(node.module_path, "") is None:
            return False
    return True


def _sequential_forward(plan: SolvedPlan) -> list[str] | None:
    """A complete forward for a root nn.Sequential, its checkpointed runs and the plain runs between."""
    graph = plan.graph
    if not _is_root_sequential(graph):
        return None
    runs = [sibling_run(module_cover(graph, region)) for region in plan.schedule.checkpointed]
    if any(run is None or run.parent for run in runs):
        return None
    lines = [
        "def checkpointed_forward(model, x):",
        '    """model(x) for your nn.Sequential `model`, with the plan applied."""',
    ]
    position, last = 0, max(block_numbers(graph, ""))
    for run in runs:
        assert run is not None
        if run.first > position:
            lines.append(f"    x = model[{position}:{run.first}](x)")
        lines.append(f"    x = checkpoint(model[{run.first}:{run.last + 1}], x, use_reentrant=False)")
        position = run.last + 1
    if position <= last:
        lines.append(f"    x = model[{position}:](x)")
    return [*lines, "    return x"]


def torch_snippet(plan: SolvedPlan) -> str:
    """Plain `torch.utils.checkpoint` code equivalent to the plan, for the model's own forward."""
    graph = plan.graph
    header = [
        f"# Checkpoint plan ({plan.solver} solver): predicted peak {format_bytes(plan.predicted_peak_bytes)} "
        f"of a {format_bytes(plan.budget_bytes)} budget, predicted overhead {plan.predicted_overhead:.1%}.",
        "# In your model's forward (`self` is the model you planned; `x` is the tensor flowing into each",
        "# region), replace the calls each region covers with the line shown. use_reentrant=False keeps",
        "# weights trainable when the input needs no grad; the default preserve_rng_state=True replays",
        "# dropout with the same masks.",
        "import torch",
        "from torch.utils.checkpoint import checkpoint",
    ]
    regions = plan.schedule.checkpointed
    if not regions:
        return "\n".join([*header[:1], "# The plan checkpoints nothing: leave the forward as it is."])
    container = per_block_container(plan)
    if container is not None:
        return "\n".join(
            [
                *header,
                "",
                f"# every block of {container}, each in its own checkpoint (what Hugging Face's",
                "# gradient_checkpointing_enable does); replace the loop over the blocks with:",
                f"for block in {python_path(container)}:",
                "    x = checkpoint(block, x, use_reentrant=False)",
            ]
        )
    sequential = _sequential_forward(plan)
    if sequential is not None:
        return "\n".join([header[0], *header[5:], "", *sequential])
    body: list[str] = []
    for number, region in enumerate(regions, start=1):
        body += ["", *_region_lines(graph, number, region)]
    return "\n".join([*header, *body])
