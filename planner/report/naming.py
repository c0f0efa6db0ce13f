"""Names a run of graph nodes in the model's own module names.

Why it exists: a region is a slice of the captured graph (`Region.start:stop`), but people think in
the modules they wrote (`blocks.3`, `layers.0 .. layers.2`), and code that applies a plan by hand
needs module names it can call. A region's *cover* is the smallest set of modules that owns exactly
the region's nodes: a module enters the cover only when every graph node inside it is inside the
region, and is lifted to its parent while the parent's nodes are all inside the region too. Nodes of
functional ops run in the code of some module (`x + self.attention(x)` in a block's forward) and are
covered with it, or are *loose* (see NOTE [loose nodes]). A region is *module-aligned* when calling
its cover's modules reproduces it.

Torch-free, like everything that reads an `ActivationGraph`.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.ir import ActivationGraph, Region

__all__ = [
    "SiblingRun",
    "describe_region",
    "display_module",
    "is_module_aligned",
    "module_cover",
    "python_path",
    "sibling_run",
]

LISTED_MODULES = 3
"""A cover of more modules than this is shown as `first .. last (n modules)`."""


def _ancestors(path: str) -> list[str]:
    """`a.b.c` -> [`a.b.c`, `a.b`, `a`] (the root, `""`, is not a module one can name)."""
    parts = path.split(".")
    return [".".join(parts[:length]) for length in range(len(parts), 0, -1)]


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _blocked(graph: ActivationGraph, region: Region) -> set[str]:
    """Modules (and the root, `""`) that run some node outside `region`."""
    return {
        ancestor
        for index, node in enumerate(graph.nodes)
        if not region.start <= index < region.stop
        for ancestor in ("", *(_ancestors(node.module_path) if node.module_path else ()))
    }


def module_cover(graph: ActivationGraph, region: Region) -> tuple[str, ...]:
    """The outermost modules whose graph nodes all lie in `region`, in execution order.

    Loose nodes (see NOTE [loose nodes]) add nothing to the cover.
    """
    blocked = _blocked(graph, region)
    cover: list[str] = []
    for node in graph.nodes[region.start : region.stop]:
        if node.module_path in blocked or not node.module_path:
            continue
        lifted = node.module_path
        for ancestor in _ancestors(node.module_path):
            if ancestor in blocked:
                break
            lifted = ancestor
        if not any(_inside(lifted, chosen) for chosen in cover):
            cover.append(lifted)
    return tuple(cover)


def is_module_aligned(graph: ActivationGraph, region: Region) -> bool:
    """True when calling the cover's modules reproduces `region`'s memory (see NOTE [loose nodes]).

    NOTE [loose nodes]: a node's `module_path` names the module whose own forward runs it: a module
    call, or a functional op in that module's code (the residual `x + ...` of a block), or `""` for
    the model's own code. A node is *loose* when that module also runs nodes outside the region, so
    no module of the cover contains it: its code sits between the cover's module calls. A loose node
    that saves nothing for backward (an addition, a view) changes nothing a checkpoint keeps; one that
    saves something (a functional relu saves its output) does, so then no module calls reproduce the
    region.
    """
    cover = module_cover(graph, region)
    return all(
        not node.saves_anything or any(_inside(node.module_path, module) for module in cover)
        for node in graph.nodes[region.start : region.stop]
    )


@dataclass(frozen=True)
class SiblingRun:
    """Modules `parent.first` .. `parent.last` (inclusive) of one ModuleList or Sequential."""

    parent: str
    first: int
    last: int


def sibling_run(cover: tuple[str, ...]) -> SiblingRun | None:
    """The cover as consecutive numbered children of one parent, if it is one."""
    if not cover:
        return None
    split = [path.rpartition(".") for path in cover]
    parents = {parent for parent, _, _ in split}
    if len(parents) != 1 or not all(child.isdigit() for _, _, child in split):
        return None
    indices = [int(child) for _, _, child in split]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        return None
    return SiblingRun(parent=parents.pop(), first=indices[0], last=indices[-1])


def display_module(path: str) -> str:
    """A module path as the report shows it: `blocks.3`, `module 3` for a child of a root Sequential."""
    if not path:
        return "the model"
    return f"module {path}" if path.isdigit() else path


def describe_region(graph: ActivationGraph, region: Region) -> str:
    """A short name for `region`: `layers.0 .. layers.2`, `blocks.3.attention`, or its node names."""
    cover = module_cover(graph, region)
    run = sibling_run(cover)
    if run is not None and run.last > run.first:
        if not run.parent:
            return f"modules {run.first} .. {run.last}"
        return f"{run.parent}.{run.first} .. {run.parent}.{run.last}"
    if cover and len(cover) <= LISTED_MODULES:
        return ", ".join(display_module(path) for path in cover)
    if cover:
        return f"{display_module(cover[0])} .. {display_module(cover[-1])} ({len(cover)} modules)"
    nodes = graph.nodes[region.start : region.stop]
    return f"nodes {nodes[0].name} .. {nodes[-1].name}"


def python_path(path: str, root: str = "self") -> str:
    """`blocks.1.attention` -> `self.blocks[1].attention`: the expression that reaches the module."""
    expression = root
    for part in path.split(".") if path else []:
        expression += f"[{part}]" if part.isdigit() else f".{part}"
    return expression
