"""Names a run of graph nodes in the model's own module names.

Why it exists: a region is a slice of the captured graph (`Region.start:stop`), but people think in
the modules they wrote (`blocks.3`, `layers.0 .. layers.2`), and code that applies a plan by hand
needs module names it can call. A region's *cover* is the smallest set of modules that owns exactly
the region's nodes: a module enters the cover only when every graph node inside it is inside the
region, and is lifted to its parent while the parent's nodes are all inside the region too. Nodes of
functional ops (`torch.relu(x)`, `x + y`) have no module; they never block a lift. A region is
*module-aligned* when calling its cover's modules reproduces it (see NOTE [functional ops]).

Torch-free, like everything that reads an `ActivationGraph`.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.ir import ActivationGraph, Region

__all__ = ["SiblingRun", "describe_region", "is_module_aligned", "module_cover", "python_path", "sibling_run"]

LISTED_MODULES = 3
"""A cover of more modules than this is shown as `first .. last (n modules)`."""


def _ancestors(path: str) -> list[str]:
    """`a.b.c` -> [`a.b.c`, `a.b`, `a`] (the root, `""`, is not a module one can name)."""
    parts = path.split(".")
    return [".".join(parts[:length]) for length in range(len(parts), 0, -1)]


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def module_cover(graph: ActivationGraph, region: Region) -> tuple[str, ...]:
    """The outermost modules whose graph nodes all lie in `region`, in execution order."""
    inside = {node.module_path for node in graph.nodes[region.start : region.stop] if node.module_path}
    blocked = {
        ancestor
        for index, node in enumerate(graph.nodes)
        if node.module_path and not region.start <= index < region.stop
        for ancestor in _ancestors(node.module_path)
    }
    cover: list[str] = []
    for node in graph.nodes[region.start : region.stop]:
        if not node.module_path:
            continue
        lifted = node.module_path
        for ancestor in _ancestors(node.module_path):
            if ancestor in blocked:
                break
            lifted = ancestor
        if lifted not in cover and not any(_inside(lifted, chosen) for chosen in cover):
            cover.append(lifted)
    assert all(any(_inside(path, module) for module in cover) for path in inside), (region, cover)
    return tuple(cover)


def _owner(path: str, cover: tuple[str, ...]) -> str | None:
    return next((module for module in cover if _inside(path, module)), None)


def is_module_aligned(graph: ActivationGraph, region: Region) -> bool:
    """True when calling the cover's modules reproduces `region`'s memory (see NOTE [functional ops]).

    NOTE [functional ops]: a node without a module runs inside a module's forward when the module
    nodes just before and after it (anywhere in the graph) belong to the same cover module: a forward
    is one contiguous call. Otherwise it may run in the parent's forward, between module calls; that
    is harmless when it saves nothing for backward (an addition, a view), and changes what the
    checkpoint keeps when it saves something (a functional relu saves its output).
    """
    cover = module_cover(graph, region)
    paths = [node.module_path for node in graph.nodes]
    for index in range(region.start, region.stop):
        node = graph.nodes[index]
        if node.module_path or not node.saves_anything:
            continue
        before = next((paths[i] for i in range(index - 1, -1, -1) if paths[i]), "")
        after = next((paths[i] for i in range(index + 1, len(paths)) if paths[i]), "")
        owner = _owner(before, cover) if before else None
        if owner is None or owner != (_owner(after, cover) if after else None):
            return False
    return True


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


def describe_region(graph: ActivationGraph, region: Region) -> str:
    """A short name for `region`: `layers.0 .. layers.2`, `blocks.3.attention`, or its node names."""
    cover = module_cover(graph, region)
    run = sibling_run(cover)
    if run is not None and run.last > run.first:
        prefix = f"{run.parent}." if run.parent else ""
        return f"{prefix}{run.first} .. {prefix}{run.last}"
    if cover and len(cover) <= LISTED_MODULES:
        return ", ".join(cover)
    if cover:
        return f"{cover[0]} .. {cover[-1]} ({len(cover)} modules)"
    nodes = graph.nodes[region.start : region.stop]
    return f"nodes {nodes[0].name} .. {nodes[-1].name}"


def python_path(path: str, root: str = "self") -> str:
    """`blocks.1.attention` -> `self.blocks[1].attention`: the expression that reaches the module."""
    expression = root
    for part in path.split(".") if path else []:
        expression += f"[{part}]" if part.isdigit() else f".{part}"
    return expression
