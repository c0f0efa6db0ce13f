"""Calls the capture could not follow, profiled as parts so that a plan can checkpoint their children.

Why it exists: FX keeps a module whose forward it cannot trace (Python control flow on tensor values) or
that carries hooks as one node, and a node is checkpointed whole or not at all. Such a call still calls
children (the layers of a block with hooks) that could be checkpointed one by one. The profiling step
runs it with hooks on its children and records parts: the call's own code between child calls (glue)
and each child call, so that a plan can checkpoint one child, by running it under checkpoint inside a
copy of the module, or the whole call (NOTE [split calls] in simulation/step.py).

A call whose children are called depending on the data (a mixture of experts routing tokens by their
values) is not split: checkpointing one expert would move bytes with the routing from step to step,
which no profile of one step can bound (`static_split_calls`).

NOTE [freed as a call returns]: the temporaries of the expression that called a child (`x +
self.dropout(self.down(h))`: the `down` output the dropout read) are freed as the child returns, before
the glue after it allocates anything, and a storage a glue part frees counts as read by it; so the
simulator, which frees what a node reads after the node's own allocations, held the `down` output
alive beside the residual sum the glue makes, and every nested block was predicted 64 KiB above its
measurement. A storage freed before its glue allocates anything is read last by the part before it,
where that part read or made it (otherwise it would become an input that part holds when
checkpointed: NOTE [the child's arguments]).

NOTE [nested units]: at the module level (capture/model_call.py) the units are the model's blocks, and
a plan of whole blocks lost to a hand method that checkpoints a smaller module in every block: on
BLOOM, whose GELU (a custom autograd Function) keeps it from torch.export, `checkpoint_wrapper` on every
BloomAttention measured 3.23 MiB where our lowest plan was 3.36 (a block's replay holds all its
intermediates at once; the attention's alone holds less). So each unit's call is split in turn: its
own code is glue with the unit as its `part_of`, and its children are parts of it. CheckpointRule
(simulation/step.py) then lets a region be one child call, or every part of one unit's call (the
unit, checkpointed whole), and never cuts the model's own code, which is not checkpointable. Units
whose children are called depending on the data stay whole (`static_units`), and FSDP's units stay
whole too: they are the modules it shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx
from torch.utils._pytree import tree_map

from planner.capture.chain import CONTAINERS, candidate_units, has_hooks
from planner.capture.kept_whole import generator_states
from planner.capture.model_call import MODEL_CALL
from planner.capture.records import Capture
from planner.ir import GLUE_OP
from planner.profiler.counting import storage_bytes, tensors_in
from planner.profiler.records import RANDOM_MODULES, Meters, NodeRecord, ProfilingTracker

__all__ = [
    "NodeRecorder",
    "SplitCall",
    "called_at_random",
    "split_calls",
    "static_split_calls",
    "static_units",
]

log = logging.getLogger(__name__)


class NodeRecorder(Protocol):
    """The profiling interpreter as a split call uses it (interpreter.py)."""

    module: torch.nn.Module
    tracker: ProfilingTracker | None
    forward_ms: dict[str, float]
    current: NodeRecord | None

    def start_node(self, record: NodeRecord) -> None: ...

    def finish_node(self, record: NodeRecord, args: Any, output: Any, *, every_new: bool = False) -> None: ...

    def call_module(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class _Level:
    """A call whose own code the split call's parts record as glue: the split call, or a nested unit's
    call inside it (NOTE [nested units])."""

    name: str
    """The `part_of` of its parts."""
    path: str
    """Its module path."""
    checkpointable: bool
    """Whether a plan may checkpoint it whole."""
    call: Any
    """Its arguments (a nested unit's), read by its last glue."""


class SplitCall:
    """One call of a module the capture could not follow, profiled as parts: its own code between its
    children's calls (glue) and each child call, so that a plan can checkpoint one child (a layer of a
    block with hooks) or the whole call (NOTE [split calls] in simulation/step.py).

    Forward hooks on the children open and close the parts. Glue creates every new storage still alive
    when it ends (the call's locals), reads what is freed while it runs and, last, the call's
    arguments; a child call is recorded like a captured node. Backward is segmented as for captured
    nodes, by pre-hooks on the grad_fns of what each part hands on (a child's output, the tensors glue
    passes to the next child).
    """

    def __init__(
        self, interpreter: NodeRecorder, node: fx.Node, units: tuple[str, ...], meters: Meters
    ) -> None:
        self.interpreter = interpreter
        self.node = node
        target = str(node.target)
        self.module = interpreter.module.get_submodule(target)
        self.path = "" if target == MODEL_CALL else target
        """The module path of the call's own code; its children's paths are under it."""
        self.whole_call_checkpointable = target != MODEL_CALL and not has_hooks(self.module)
        self.units = units
        self.hooked = {unit for unit in units if has_hooks(self.module.get_submodule(unit))}
        """Children with hooks of their own (before this profiler adds its hooks)."""
        self.meters = meters
        self.parts: list[NodeRecord] = []
        self.calls: dict[str, int] = {}
        self.started = 0.0
        self.child_call: Any = ()
        """The arguments of the child call that runs now."""
        self.child_outputs: dict[str, tuple[str, list[str]]] = {}
        """Each child part -> the call it is part of and the storages its output holds (NOTE [outputs
        the caller holds])."""
        self.nested = frozenset(
            unit for unit in units if any(other.startswith(f"{unit}.") for other in units)
        )
        """Units whose own children are units too, split in turn (NOTE [nested units])."""
        self.levels: list[_Level] = [_Level(node.name, self.path, self.whole_call_checkpointable, ())]
        """The calls open now, the split call first and the nested unit that runs now last."""

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tracker = self.interpreter.tracker
        handles = []
        for unit in self.units:
            child = self.module.get_submodule(unit)
            before = self._enter if unit in self.nested else self._before_child
            after = self._leave if unit in self.nested else self._after_child
            handles.append(
                child.register_forward_pre_hook(
                    lambda _m, a, k, unit=unit, before=before: before(unit, (a, k)), with_kwargs=True
                )
            )
            handles.append(
                child.register_forward_hook(lambda _m, a, k, out, after=after: after(out), with_kwargs=True)
            )
        self._open_glue()
        if tracker is not None:
            tracker.on_free = self._freed
        try:
            output = self.interpreter.call_module(self.node.target, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()
            if tracker is not None:
                tracker.on_free = None
        self._close(self.parts[-1], (args, kwargs), output)
        self._hold_unread_outputs(self.node.name)
        for part in self.parts:
            if self.calls.get(part.module_path, 1) > 1:
                part.checkpointable = False  # one region would checkpoint several calls
        return output

    def _open(self, part: NodeRecord) -> None:
        previous = self.parts[-1].name if self.parts else None
        part.inputs = (previous,) if previous else tuple(str(a) for a in self.node.all_input_nodes)
        self.parts.append(part)
        self.interpreter.start_node(part)
        self.started = time.perf_counter()

    def _open_glue(self) -> None:
        """Open a part for the code of the call that runs now (the split call's, or a nested unit's)."""
        level = self.levels[-1]
        glue = sum(part.op == GLUE_OP and part.part_of == level.name for part in self.parts)
        module = self.module.get_submodule(level.path[len(self.path) :].lstrip("."))
        self._open(
            NodeRecord(
                name=f"{level.name}.glue{glue}",
                op=GLUE_OP,
                module_path=level.path,
                inputs=(),
                stateful=any(True for _ in module.buffers()),
                checkpointable=level.checkpointable,
                part_of=level.name,
            )
        )

    def _close(self, part: NodeRecord, inputs: Any, handed_on: Any) -> None:
        """End `part`; `handed_on` is what it passes to the next part (or returns)."""
        self.interpreter.forward_ms[part.name] = (time.perf_counter() - self.started) * 1e3
        tracker = self.interpreter.tracker
        glue = part.op == GLUE_OP
        if glue:
            moved_bytes = 2 * (tracker.allocated_since_mark_bytes if tracker is not None else 0)
            self.meters.charge(part, inputs, handed_on, glue_moved_bytes=moved_bytes)
            self.interpreter.finish_node(part, inputs, handed_on, every_new=True)
        else:
            self.meters.charge(part, inputs, handed_on)
            self.interpreter.finish_node(part, inputs, handed_on)

    def _counted_call(self, unit: str) -> tuple[str, str]:
        """The module path of a call of `unit` and the name of its part (or of its nested call)."""
        path = f"{self.path}.{unit}" if self.path else unit
        self.calls[path] = self.calls.get(path, 0) + 1
        count = self.calls[path]
        return path, f"{self.node.name}.{unit}" + (f"#{count}" if count > 1 else "")

    def _enter(self, unit: str, call: Any) -> None:
        """A nested unit's call begins: its own code is glue of its own (NOTE [nested units])."""
        self._close(self.parts[-1], (), call)
        path, name = self._counted_call(unit)
        self.levels.append(_Level(name, path, unit not in self.hooked, call))
        self._open_glue()

    def _leave(self, output: Any) -> None:
        level = self.levels[-1]
        part = self.parts[-1]
        self._close(part, level.call, output)
        self._hold_unread_outputs(level.name)
        self.levels.pop()
        self._note_output(part, output)
        self._open_glue()

    def _before_child(self, unit: str, call: Any) -> None:
        self._close(self.parts[-1], (), call)
        path, name = self._counted_call(unit)
        child = self.module.get_submodule(unit)
        self._open(
            NodeRecord(
                name=name,
                op=type(child).__name__,
                module_path=path,
                inputs=(),
                random=isinstance(child, RANDOM_MODULES),
                stateful=any(True for _ in child.buffers()),
                buffer_bytes=storage_bytes(child.buffers()),
                checkpointable=unit not in self.hooked,
                part_of=self.levels[-1].name,
            )
        )
        self.child_call = call

    def _after_child(self, output: Any) -> None:
        """NOTE [the child's arguments]: the child call's arguments are let go as it ends. Kept until
        the next child's call began, they kept alive what the caller's code drops in between (wav2vec2's
        encoder rebinds `hidden_states` to the dropout's output, freeing the normalised input), so the
        free was recorded in the next child's part, as its read; a plan that checkpointed that child held
        the storage as its input until its backward, and wav2vec2's plans were predicted up to 162,816
        bytes (1.6 %) above their measurement."""
        part = self.parts[-1]
        self._close(part, self.child_call, output)
        self.child_call = ()
        self._note_output(part, output)
        self._open_glue()

    def _note_output(self, part: NodeRecord, output: Any) -> None:
        """Note what a child call of the call that runs now (ended by `part`) hands back."""
        tracker = self.interpreter.tracker
        if tracker is not None:
            names = (tracker.name_of(tensor, create=False) for tensor in tensors_in(output))
            self.child_outputs[part.name] = (
                self.levels[-1].name,
                [name for name in names if name is not None],
            )

    def _hold_unread_outputs(self, call: str) -> None:
        """NOTE [outputs the caller holds]: a child's output that no later part reads is held by the
        call's code until the call returns (`outputs = self.wav2vec2(...)` keeps every field of the
        output, read or not, until the loss is computed). In the profiled step the child itself saves it
        for backward, so no free shows when the frame lets it go; checkpointed, the child saves nothing,
        and wav2vec2's feature projection's unread `extract_features` (81,408 bytes) was predicted freed
        at once where the forward held it to its end. The call's last part reads such an output: an
        upper bound, as the code may drop it sooner."""
        last = self.parts[-1]
        read_later: set[str] = set()
        for part in reversed(self.parts):
            caller, names = self.child_outputs.get(part.name, ("", []))
            for name in names if caller == call else ():
                if name not in read_later and name not in last.reads:
                    last.reads.append(name)
            read_later.update(part.reads)

    def _freed(self, name: str) -> None:
        """A named storage freed while a part runs: that part is its last reader, unless it is glue that
        has allocated nothing yet and the part before it read or made the storage (NOTE [freed as a
        call returns])."""
        part = self.interpreter.current
        if part is None or name in part.reads or name in part.creates:
            return
        tracker = self.interpreter.tracker
        if part.op == GLUE_OP and len(self.parts) > 1 and tracker is not None:
            previous = self.parts[-2]
            if tracker.allocated_since_mark_bytes == 0 and (
                name in previous.reads or name in previous.creates
            ):
                if name not in previous.reads:
                    previous.reads.append(name)
                return
        part.reads.append(name)


def split_calls(captured: Capture, *, nested: bool = True) -> dict[str, tuple[str, ...]]:
    """Modules the capture kept as one node (opaque, or whole for their hooks) whose calls are
    profiled in parts, with the children that cut them (NOTE [split calls] in simulation/step.py), and
    with `nested`, at the module level, their children's children (NOTE [nested units])."""
    graph_module = captured.graph_module
    found: dict[str, tuple[str, ...]] = {}
    for node in graph_module.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        module = graph_module.get_submodule(target)
        if target in captured.opaque_modules or has_hooks(module):
            units = tuple(candidate_units(module))
            if units and nested and target == MODEL_CALL and captured.nested_units:
                units = _with_their_children(module, units)
            if units:
                found[target] = units
    return found


def _with_their_children(module: torch.nn.Module, units: tuple[str, ...]) -> tuple[str, ...]:
    """`units`, each followed by its own children (NOTE [nested units])."""
    return tuple(path for unit in units for path in (unit, *_children_of(module, unit)))


def _children_of(module: torch.nn.Module, path: str) -> list[str]:
    """The children of the submodule at `path`, containers replaced by their children."""
    found: list[str] = []
    for name, child in module.get_submodule(path).named_children():
        found.extend(
            _children_of(module, f"{path}.{name}") if isinstance(child, CONTAINERS) else [f"{path}.{name}"]
        )
    return found


def static_units(
    graph_module: fx.GraphModule, inputs: tuple[Any, ...], captured: Capture
) -> dict[str, tuple[str, ...]]:
    """The split calls to profile and their units: nested units where their calls are static too, else
    the units alone (a block whose children are called by the data is still checkpointed whole)."""
    candidates = split_calls(captured)
    split = static_split_calls(graph_module, inputs, candidates)
    unnested = {
        target: units
        for target, units in split_calls(captured, nested=False).items()
        if target not in split and units != candidates[target]
    }
    return split | static_split_calls(graph_module, inputs, unnested)


def static_split_calls(
    graph_module: fx.GraphModule, inputs: tuple[Any, ...], candidates: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """The `candidates` whose children's calls do not depend on the data: the same children called as
    often with arguments of the same shapes (in any order) when the call's floating inputs are perturbed.

    A mixture of experts routes each token by its values: checkpointing one expert would save bytes
    that change with the routing from step to step (fewer tokens to a checkpointed expert leave more to
    the stored ones), which no profile of one step can bound. Such a call stays one node (checkpointed
    whole, its total is the same for any routing). A call that draws from Python's or NumPy's generator
    (NOTE [Python draws] in capture/kept_whole.py) may call other children as the draw says, which three
    probes need not see (a layer skipping itself at p = 0.5 was split after one profile in four): it is
    split only where `called_at_random`'s forwards all call the same children. Runs one forward, and each
    candidate twice more per call (and up to `RANDOM_CALL_PROBES` more where it draws so), with grad
    enabled as a training step runs them (a forward may take a gradient of its own); the caller restores
    buffers and the random state.
    """
    verdicts: dict[str, bool] = {}
    if not candidates:
        return {}

    def probe(target: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        units = candidates[target]
        generators = generator_states()
        seen = [_child_calls(module, units, args, kwargs)]
        for _ in range(PERTURBED_PROBES):
            seen.append(_child_calls(module, units, *_perturbed((args, kwargs))))
        static = seen[0] is not None and all(calls == seen[0] for calls in seen)
        if static and generator_states() != generators:
            static = not called_at_random(module, units, args, kwargs)
        verdicts[target] = verdicts.get(target, True) and static

    handles = [
        graph_module.get_submodule(target).register_forward_pre_hook(
            lambda module, args, kwargs, target=target: probe(target, module, args, kwargs), with_kwargs=True
        )
        for target in candidates
    ]
    try:
        with torch.enable_grad():
            graph_module(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    for target, static in verdicts.items():
        if not static:
            log.info("%s calls its children depending on the data or a draw: it stays one node", target)
    return {target: units for target, units in candidates.items() if verdicts.get(target, False)}


PERTURBED_PROBES = 2
"""Perturbed inputs each split candidate is run on to see whether its children's calls change."""


def _child_calls(
    module: torch.nn.Module, units: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, tuple[tuple[int, ...], ...]]] | None:
    """The children `module.forward` calls, with their tensor arguments' shapes, sorted (None when it
    fails on these inputs)."""
    calls: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
    handles = [
        module.get_submodule(unit).register_forward_pre_hook(
            lambda _m, a, k, unit=unit: calls.append(
                (unit, tuple(tuple(t.shape) for t in tensors_in((a, k))))
            ),
            with_kwargs=True,
        )
        for unit in units
    ]
    try:
        module.forward(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an input the call cannot take tells nothing about static calls
        return None
    finally:
        for handle in handles:
            handle.remove()
    return sorted(calls)


RANDOM_CALL_PROBES = 16
"""Forwards on the same inputs `called_at_random` compares: with 2 layers each dropped with probability
0.1, the chance that all 16 call the same layers is below 4 %."""


def called_at_random(
    module: torch.nn.Module, units: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether forwards of `module` on the same inputs call other `units` (or with other shapes) from
    one run to the next: layers skipped at random (LayerDrop, stochastic depth by skipping), which the
    probe of `static_split_calls` cannot tell from calls that follow the data. Runs up to
    `RANDOM_CALL_PROBES` forwards with grad enabled; the caller restores buffers and the RNG state."""
    first = None
    with torch.enable_grad():
        for _ in range(RANDOM_CALL_PROBES):
            calls = _child_calls(module, units, args, kwargs)
            if calls is None:
                return False
            if first is not None and calls != first:
                return True
            first = calls
    return False


def _perturbed(call: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call with noise of each floating tensor's own scale added to it."""

    def perturb(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value + torch.randn_like(value) * (value.detach().std() if value.numel() > 1 else 1.0)
        return value

    args, kwargs = tree_map(perturb, call)
    return tuple(args), dict(kwargs)
