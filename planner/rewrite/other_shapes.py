"""`plan.module` at shapes other than the example's: which captured graph runs a call, and how a
schedule carries over to a graph captured at another shape.

Why it exists: people plan with one example batch and train on many shapes: a short last batch
(`drop_last=False` is the default of DataLoader and of the Hugging Face Trainer), dynamic padding,
packing, curriculum sequence lengths. An FX graph runs at any shape; a graph exported with dynamic
dimensions runs at every shape inside its ranges and guards (NOTE [other shapes] in capture/records.py). A
call that the captured graph does not admit (outside those ranges and guards, another dtype or
layout, a model export could only capture at the example's shapes, an FX graph with an inlined
exported container) is captured again at its own shape, once per shape (`CallDispatch`), and the
plan's regions are carried over to the new graph; nothing is profiled again.

NOTE [carried regions]: a graph captured at another shape holds the same operations as the profiled
one, give or take shape plumbing (a slice export drops where it is a no-op at one shape and keeps at
another, `sym_size` and arithmetic on sizes in a dynamic graph). `align_names` matches the two graphs'
operations in order (the longest matching subsequence of their operator sequences), and a region of
the new graph runs from the first to the last operation matched to its profiled nodes, so an unmatched
operation between two matched ones of one region joins it (a region must stay contiguous to be fused)
and one between regions stays outside. Selective keeps carry over where matched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from planner.capture.chain import capture
from planner.capture.records import Capture, GraphCall, call_shapes
from planner.errors import UnsupportedModel
from planner.ir import GLUE_OP, ActivationGraph, Region, RegionPolicy, Schedule

__all__ = [
    "MANY_SHAPES",
    "CallDispatch",
    "RegionNodes",
    "align_names",
    "carry_regions",
    "carry_schedule",
    "constants_on_meta",
    "is_larger",
    "meta_copy",
    "outside_modes",
    "regions_of",
]

log = logging.getLogger(__name__)

MANY_SHAPES = 8
"""Captures of one planned module after which it warns (once) that each new shape costs a capture."""

OPERATIONS = ("call_function", "call_method", "call_module")
SHAPE_VALUES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
"""What a node computing on sizes returns (`sym_size`, `s0 * s1`): shape plumbing, not an operation
on tensors, so it takes no part in aligning two captures."""


@dataclass(frozen=True)
class RegionNodes:
    """A checkpointed region as FX node names, in execution order, and the names of its kept nodes.

    A region that is one child call of a split call (NOTE [split calls] in simulation/step.py) names its
    caller's node and has `unit_path`, the child's module path: the child runs under checkpoint
    inside a copy of its caller, the caller's node stays in the graph."""

    names: tuple[str, ...]
    keep: frozenset[str]
    unit_path: str | None = None
    whole_calls: bool = False
    """Whether the region holds the whole of a split call: code FX could not trace, which torch.compile
    may break its graph in (NOTE [checkpointed breaks] in planner/rewrite/emit.py)."""
    draws_python: bool = False
    """Whether a node of the region drew from Python's or NumPy's global generator when profiled: its
    replay sets them back (NOTE [Python draws replayed] in planner/rewrite/emit.py)."""


def regions_of(graph: ActivationGraph, schedule: Schedule) -> list[RegionNodes]:
    """The checkpointed regions of `schedule` as the node names of `graph` (the captured graph's)."""
    return [_region_nodes(graph, region) for region in schedule.checkpointed]


def _region_nodes(graph: ActivationGraph, region: Region) -> RegionNodes:
    """`region` of `graph` as FX node names: the parts of a split call are its caller's node."""
    nodes = graph.nodes[region.start : region.stop]
    first = nodes[0]
    draws_python = any(node.draws_python for node in nodes)
    if len(nodes) == 1 and first.part_of and first.op != GLUE_OP:
        return RegionNodes(
            names=(first.part_of,), keep=frozenset(), unit_path=first.module_path, draws_python=draws_python
        )
    return RegionNodes(
        names=tuple(dict.fromkeys(node.part_of or node.name for node in nodes)),
        keep=frozenset(graph.nodes[index].name for index in region.keep),
        whole_calls=any(node.op == GLUE_OP and node.part_of for node in nodes),
        draws_python=draws_python,
    )


def _operations(graph: fx.Graph) -> list[fx.Node]:
    return [
        node
        for node in graph.nodes
        if node.op in OPERATIONS and not isinstance(node.meta.get("val"), SHAPE_VALUES)
    ]


def _key(node: fx.Node) -> tuple[str, str]:
    return node.op, str(node.target)


def align_names(old: fx.Graph, new: fx.Graph) -> dict[str, str]:
    """Old operation name -> new operation name, for the operations the graphs share in order (see
    NOTE [carried regions])."""
    old_nodes, new_nodes = _operations(old), _operations(new)
    matcher = difflib.SequenceMatcher(
        a=[_key(node) for node in old_nodes], b=[_key(node) for node in new_nodes], autojunk=False
    )
    names: dict[str, str] = {}
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            names[old_nodes[block.a + offset].name] = new_nodes[block.b + offset].name
    return names


def _carried(
    names: Sequence[str], keep: frozenset[str], matched: Mapping[str, str], order: Mapping[str, int]
) -> tuple[int, int, frozenset[str]] | None:
    """(first, last) positions in the new graph of a region's matched nodes, and its kept ones."""
    present = [matched[name] for name in names if matched.get(name) in order]
    if not present:
        return None
    positions = [order[name] for name in present]
    kept = frozenset(matched[name] for name in keep if matched.get(name) in order)
    return min(positions), max(positions), kept


def carry_regions(regions: Sequence[RegionNodes], old: fx.Graph, new: fx.Graph) -> list[RegionNodes]:
    """`regions` of the profiled graph `old`, as regions of `new` (see NOTE [carried regions])."""
    matched = align_names(old, new)
    new_nodes = [node.name for node in new.nodes if node.op in OPERATIONS]
    order = {name: index for index, name in enumerate(new_nodes)}
    carried = []
    for region in regions:
        span = _carried(region.names, region.keep, matched, order)
        if span is not None:
            first, last, kept = span
            names = tuple(new_nodes[first : last + 1])
            carried.append(dataclasses.replace(region, names=names, keep=kept))
    return carried


def carry_schedule(
    schedule: Schedule, old: ActivationGraph, new: ActivationGraph, matched: Mapping[str, str]
) -> Schedule:
    """`schedule` of `old` as a schedule of `new`, whose FX node names `matched` maps old ones to; the
    nodes between the carried regions are stored."""
    order = {node.name: index for index, node in enumerate(new.nodes)}
    by_node = _node_names(old, matched)
    regions: list[Region] = []
    stored_from = 0
    for region in schedule.checkpointed:
        names = [node.name for node in old.nodes[region.start : region.stop]]
        keep = frozenset(old.nodes[index].name for index in region.keep)
        span = _carried(names, keep, by_node, order)
        if span is None:
            continue
        first, last, kept = span
        if first > stored_from:
            regions.append(Region(stored_from, first, RegionPolicy.STORE))
        regions.append(Region(first, last + 1, region.policy, keep=tuple(sorted(order[n] for n in kept))))
        stored_from = last + 1
    if stored_from < len(new.nodes):
        regions.append(Region(stored_from, len(new.nodes), RegionPolicy.STORE))
    return Schedule(regions=tuple(regions), solver=schedule.solver, gap=schedule.gap)


def _node_names(old: ActivationGraph, matched: Mapping[str, str]) -> dict[str, str]:
    """Old activation-graph node name -> new one, from the FX names `matched` maps: a part of a split
    call is named after its caller's node ("encoder.layers.0" of "encoder" is "encoder_1.layers.0")."""
    names = {}
    for node in old.nodes:
        if node.part_of and node.part_of in matched:
            names[node.name] = matched[node.part_of] + node.name[len(node.part_of) :]
        elif node.name in matched:
            names[node.name] = matched[node.name]
    return names


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """Run planner work inside a user's step (a capture, a prediction) outside their dispatch modes,
    so that a memory tracker counting their step does not count ours."""
    with _disable_current_modes():
        yield


@contextlib.contextmanager
def _training(model: torch.nn.Module) -> Iterator[None]:
    """Capture the root in training mode, as the planned module runs it (its submodules are shared)."""
    was_training = model.training
    model.training = True
    try:
        yield
    finally:
        model.training = was_training


Split = Callable[[fx.GraphModule, Sequence[RegionNodes]], fx.GraphModule]
"""Fuses the regions of a captured graph into checkpointed calls (emit.py's `_split`)."""


class CallDispatch:
    """The captured graphs a planned module runs, each with the calls it admits; a call none admits
    is captured again at its shape and kept for the calls like it (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, profiled: Capture, regions: Sequence[RegionNodes], split: Split
    ) -> None:
        self.model = model
        self.profiled = dataclasses.replace(profiled, inputs=())
        """Without the example call: a planned module must neither keep the user's batch alive nor copy it
        (`copy.deepcopy` of a tensor made by `.to("cuda")` from one that requires grad raises)."""
        self.regions = list(regions)
        self.split = split
        self.entries: list[tuple[GraphCall, fx.GraphModule]] = [
            (profiled.call, split(profiled.graph_module, self.regions))
        ]
        self._warned_many = False

    @property
    def example_split(self) -> fx.GraphModule:
        """The split graph of the profiled capture (the example's shape)."""
        return self.entries[0][1]

    def select(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[fx.GraphModule, tuple[Any, ...], dict[str, Any]]:
        """The split graph that runs `model(*args, **kwargs)` and the arguments to call it with."""
        for call, split in self.entries:
            if call.admits(args, kwargs):
                graph_args, graph_kwargs = call.graph_arguments(args, kwargs)
                return split, graph_args, graph_kwargs
        call, split = self._capture_again(args, kwargs)
        graph_args, graph_kwargs = call.graph_arguments(args, kwargs)
        return split, graph_args, graph_kwargs

    def _capture_again(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[GraphCall, fx.GraphModule]:
        log.info(
            "plan.module: the captured graph does not admit tensor shapes %s; capturing %s at them",
            call_shapes(args, kwargs),
            type(self.model).__name__,
        )
        with outside_modes(), _training(self.model):
            captured = capture(self.model, tuple(args), dict(kwargs))
        if captured.path.split(" ")[0] != self.profiled.path.split(" ")[0]:
            raise UnsupportedModel(
                f"plan.module: at tensor shapes {call_shapes(args, kwargs)} the model was captured by "
                f"{captured.path!r}, not by {self.profiled.path!r} as at the example's; plan with an "
                "example of this shape (planner.optimize)"
            )
        regions = carry_regions(self.regions, self.profiled.graph_module.graph, captured.graph_module.graph)
        entry = (captured.call, self.split(captured.graph_module, regions))
        self.entries.append(entry)
        if len(self.entries) > MANY_SHAPES and not self._warned_many:
            self._warned_many = True
            warnings.warn(
                f"plan.module has captured {type(self.model).__name__} at {len(self.entries)} shapes, as its "
                "first graph does not admit them (each capture costs one torch.export); pad batches to a "
                "few fixed lengths",
                stacklevel=4,
            )
        return entry


def is_larger(example: Sequence[tuple[int, ...] | None], call: Sequence[tuple[int, ...] | None]) -> bool:
    """True when a call's tensors are larger than the example's: some tensor has a longer dimension
    than the example's tensor at the same place, or, for calls of another structure, the call's
    tensors (scalars aside: the Trainer adds `num_items_in_batch`) have more elements in all."""
    same_structure = len(example) == len(call) and all(
        (a is None) == (b is None) for a, b in zip(example, call, strict=True)
    )
    if same_structure:
        for example_shape, call_shape in zip(example, call, strict=True):
            if example_shape is not None and call_shape is not None:
                if len(example_shape) != len(call_shape) or any(
                    size > limit for size, limit in zip(call_shape, example_shape, strict=True)
                ):
                    return True
        return False
    return _elements(call) > _elements(example)


def _elements(shapes: Sequence[tuple[int, ...] | None]) -> int:
    total = 0
    for shape in shapes:
        if shape:
            count = 1
            for size in shape:
                count *= size
            total += count
    return total


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters, buffers and other tensor attributes (a table of
    frequencies kept as a plain attribute) are on the meta device, without storage: its structure,
    attributes and hooks are the model's, and nothing of its size is allocated."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(
            torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
        )
    tensors = [*model.buffers()]
    tensors += [value for module in model.modules() for value in vars(module).values()]
    for tensor in (value for value in tensors if isinstance(value, torch.Tensor)):
        if id(tensor) not in memo:
            memo[id(tensor)] = torch.empty_like(tensor, device="meta")
    return copy.deepcopy(model, memo)


def constants_on_meta(graph_module: fx.GraphModule) -> None:
    """Move the tensor constants of a graph captured from a `meta_copy` to the meta device: tracing
    evaluates code that involves no input (a table of frequencies from `torch.arange(64)`) on the
    CPU and keeps the result as a constant."""
    for node in graph_module.graph.find_nodes(op="get_attr"):
        owner_path, _, name = str(node.target).rpartition(".")
        owner = graph_module.get_submodule(owner_path)
        value = getattr(owner, name)
        if isinstance(value, torch.Tensor) and not value.is_meta:
            setattr(owner, name, torch.empty_like(value, device="meta"))
