"""Where a model's stack of repeated blocks is (`blocks.0`, `blocks.1`, ... of a ModuleList or Sequential).

Why it exists: the per-block baseline of the what-ifs, the exported code, the size of the unit FSDP
gathers and the benchmarks' hand-written peers all need the model's block stack; each used to find
it its own way. They ask here, in one of two views:

- on a captured graph (torch-free): a *numbered container* is a module path whose children appear as
  `path.<k>` in the nodes' module paths (`block_number`, `block_numbers`, `numbered_containers`);
  `block_spans` cuts the node order into one span per block, and `main_container` picks the stack
  whose blocks run the same operations, the one with the most nodes;
- on an `nn.Module` (imports torch when called): `longest_block_stack` is the ModuleList or
  Sequential with the most children, the first of equals in `named_modules()` order.

The views can disagree (a ModuleList of 20 one-op heads is the longest stack, but not the main
container of a model whose 12 layers hold most of the nodes); each caller keeps the view it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.ir import ActivationGraph

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "block_number",
    "block_numbers",
    "block_spans",
    "longest_block_stack",
    "main_container",
    "numbered_containers",
]


def block_number(module_path: str, container: str) -> int | None:
    """k when `module_path` is `container.k` or inside it (`container` "" is the root), else None."""
    prefix = f"{container}." if container else ""
    rest = module_path.removeprefix(prefix) if module_path.startswith(prefix) else ""
    head = rest.split(".")[0]
    return int(head) if head.isdigit() else None


def block_numbers(graph: ActivationGraph, container: str) -> set[int]:
    """Numbers of the children `container.<k>` that appear in the graph."""
    numbers = (block_number(node.module_path, container) for node in graph.nodes)
    return {number for number in numbers if number is not None}


def numbered_containers(graph: ActivationGraph) -> list[str]:
    """Modules with numbered children in the graph (`blocks` for `blocks.0`, `blocks.1`, ...)."""
    found: dict[str, None] = {}
    for node in graph.nodes:
        parts = node.module_path.split(".") if node.module_path else []
        for depth, part in enumerate(parts):
            if part.isdigit():
                found.setdefault(".".join(parts[:depth]), None)
    return list(found)


def block_spans(graph: ActivationGraph, container: str) -> list[tuple[int, int]]:
    """[start, stop) of each block: its first node up to the next node of another module.

    Functional ops at a block's end (the residual addition) have no module and belong to the block.
    """
    first: dict[int, int] = {}
    owner: list[int | None] = []
    for index, node in enumerate(graph.nodes):
        number = block_number(node.module_path, container)
        owner.append(number)
        if number is not None:
            first.setdefault(number, index)
    spans = []
    for number, start in sorted(first.items(), key=lambda item: item[1]):
        stop = start + 1
        while (
            stop < len(graph.nodes)
            and graph.nodes[stop].checkpointable
            and (owner[stop] == number or not graph.nodes[stop].module_path)
        ):
            stop += 1
        spans.append((start, stop))
    return spans


def main_container(graph: ActivationGraph) -> str | None:
    """The model's stack of repeated blocks (`blocks`, `layers`), or None when it has none.

    A stack is a numbered container of two or more blocks that run the same sequence of operations,
    more than one each; of several, the one with the most nodes.
    """
    sizes: dict[str, int] = {}
    for container in numbered_containers(graph):
        spans = block_spans(graph, container)
        shapes = {tuple(node.op for node in graph.nodes[start:stop]) for start, stop in spans}
        if len(spans) >= 2 and len(shapes) == 1 and len(shapes.pop()) > 1:
            sizes[container] = sum(stop - start for start, stop in spans)
    return max(sizes, key=lambda container: sizes[container]) if sizes else None


def longest_block_stack(model: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """(path, module) of the ModuleList or Sequential with the most children (the root included), the
    first of equals in `named_modules()` order; None when the model has neither."""
    from torch import nn

    stacks: list[tuple[str, nn.ModuleList | nn.Sequential]] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            stacks.append((path, module))
    return max(stacks, key=lambda stack: len(stack[1])) if stacks else None
