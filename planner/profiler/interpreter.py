"""Runs one profiling training step through the captured graph and records an ActivationGraph.

Memory is measured, not inferred from shapes: a `LiveStorageTracker` counts storages, and
`torch.autograd.graph.saved_tensors_hooks` reports what autograd really keeps for each node (a Linear
its input, a ReLU its output, a view nothing new), attributed to storages so that a tensor saved by
two nodes counts once. Backward is segmented per node by pre-hooks on each node's `grad_fn`; autograd
on one device runs nodes in reverse creation order, which is the graph's reverse execution order.

The profiling step leaves the model as it found it: gradients go to `torch.autograd.grad` instead of
`.grad`, and the RNG state and every buffer (BatchNorm statistics) are restored afterwards.

The measured peaks become each node's workspace in calibration.py, against the simulator itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from planner.capture.chain import replays_safely
from planner.capture.kept_whole import drawing_generators_restored
from planner.capture.records import Capture
from planner.ir import ActivationGraph, CostModel, MemoryCounting, Node, TrainingStep
from planner.profiler.attention import planned_attention
from planner.profiler.calibration import calibrate_workspace
from planner.profiler.cost_model import BACKWARD_FACTOR, DeviceSpec, analytic_forward_ms
from planner.profiler.counting import (
    counted_bytes,
    counting_scope,
    current_counting,
    storage_bytes,
    storage_of,
    tensors_in,
)
from planner.profiler.measurement import OptimizerSpec, end_autocast_forward, start_autocast_forward
from planner.profiler.records import (
    RANDOM_FUNCTIONS,
    RANDOM_MODULES,
    Meters,
    NodeRecord,
    ProfilingTracker,
    ReleasedOnUnpack,
    UnpackedAgain,
    forbid_replaying_mutated_inputs,
    free_dead_values,
)
from planner.profiler.selective_cost import draws_random_numbers
from planner.profiler.split_calls import SplitCall, static_units
from planner.profiler.static_memory import constant_bytes, extra_static_tensors, optimizer_name, static_bytes
from planner.profiler.step_prices import checkpoint_cost, cost_spec, device_of, selective_op_overhead_ms

__all__ = ["LOSS_NODE", "build_activation_graph"]

log = logging.getLogger(__name__)

LOSS_NODE = "loss"
TIMING_REPEATS = 3
"""Timed profiling steps after the measuring one; per-node times are their minimums: noise on a shared
machine only adds time (preemption, other jobs' cache misses), so the fastest run is a node's own cost."""


def _describe(node: fx.Node, graph_module: fx.GraphModule) -> tuple[str, str]:
    """(human op label, module path) of an FX node."""
    if node.op == "call_module":
        module = graph_module.get_submodule(str(node.target))
        return f"{type(module).__name__}", str(node.target)
    module_stack = node.meta.get("nn_module_stack") or {}
    module_path = str(list(module_stack.values())[-1][0]) if module_stack else ""
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)), module_path
    return f".{node.target}()", module_path


def _buffer_bytes(node: fx.Node, graph_module: fx.GraphModule) -> int:
    """Bytes of the buffers `node` reads, its module's or those its `get_attr` inputs fetch: what a
    replay copies to restore them (NOTE [buffer copies] in simulation/replay.py)."""
    if node.op == "call_module":
        return storage_bytes(graph_module.get_submodule(str(node.target)).buffers())
    fetched = []
    for source in node.all_input_nodes:
        if source.op == "get_attr":
            owner, _, name = str(source.target).rpartition(".")
            buffer = graph_module.get_submodule(owner)._buffers.get(name)
            if buffer is not None:
                fetched.append(buffer)
    return storage_bytes(fetched)


def _flags(node: fx.Node, graph_module: fx.GraphModule) -> dict[str, bool]:
    if node.op == "call_module":
        module = graph_module.get_submodule(str(node.target))
        return {
            "random": isinstance(module, RANDOM_MODULES),
            "stateful": any(True for _ in module.buffers()),
            "in_place": bool(getattr(module, "inplace", False)),
            # a replay would run its hooks twice (NOTE [hooks], NOTE [replayable hooks] in capture/chain.py)
            "checkpointable": replays_safely(module),
        }
    target_name = getattr(node.target, "__name__", str(node.target))
    schema = getattr(node.target, "_schema", None)  # ATen operators (torch.export graphs)
    return {
        "random": (
            node.target in RANDOM_FUNCTIONS or draws_random_numbers(node.target, node.args, node.kwargs)
        ),
        "stateful": False,
        "in_place": bool(node.kwargs.get("inplace", False))
        or (node.op == "call_method" and target_name.endswith("_"))
        or (schema is not None and schema.is_mutable),
    }


class _ProfilingInterpreter(fx.Interpreter):
    """Runs the graph node by node, attributing memory, saved tensors and grad_fns to FX nodes."""

    def __init__(
        self,
        graph_module: fx.GraphModule,
        tracker: ProfilingTracker | None,
        split_units: Mapping[str, tuple[str, ...]],
    ) -> None:
        super().__init__(graph_module)
        free_dead_values(self)
        self.tracker = tracker
        self.split_units = split_units
        """Per module target whose calls are profiled in parts: its children (NOTE [split calls])."""
        self.records: dict[str, NodeRecord] = {}
        self.order: list[str] = []
        self.forward_ms: dict[str, float] = {}
        self.grad_fn_owner: dict[int, str] = {}
        self.hooked_grad_fns: list[Any] = []
        self.current: NodeRecord | None = None
        self.created: set[str] = set()
        self.saved: list[tuple[NodeRecord, str | None, weakref.ref[torch.Tensor]]] = []
        """Every save while tracking: its node, its storage's name (None if static) and its holder."""

    def start_node(self, record: NodeRecord) -> None:
        self.records[record.name] = record
        self.order.append(record.name)
        self.current = record
        if self.tracker is not None:
            self.tracker.fresh_storages()
            self.tracker.reset_peak()

    def finish_node(self, record: NodeRecord, args: Any, output: Any, *, every_new: bool = False) -> None:
        """Record what the node made and read. It creates the new storages its output holds, or with
        `every_new` every new storage still alive (a split call's glue: its locals live on)."""
        tracker = self.tracker
        if tracker is not None:
            record.forward_peak_bytes = tracker.peak_bytes + tracker.library_workspace_bytes()
            record.keep_cache_bytes = tracker.keep_cache_since_mark_bytes
            fresh = {id(storage): storage for storage in tracker.fresh_storages()}
            made = (
                list(fresh.values()) if every_new else [storage_of(tensor) for tensor in tensors_in(output)]
            )
            for storage in made:
                if id(storage) in fresh:
                    name = tracker.name_of_storage(storage, create=True)
                    if name is not None and name not in self.created:
                        self.created.add(name)
                        record.creates.append(name)
            for tensor in tensors_in(args):
                name = tracker.name_of(tensor, create=False)
                if name is not None and name not in record.reads:
                    record.reads.append(name)
        for tensor in tensors_in(output):
            grad_fn = tensor.grad_fn
            if grad_fn is not None and id(grad_fn) not in self.grad_fn_owner:
                self.grad_fn_owner[id(grad_fn)] = record.name
                self.hooked_grad_fns.append(grad_fn)
        self.current = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack hook: record the saved tensor, keep it as autograd would.

        While measuring, autograd keeps a detached alias (same storage), whose lifetime is autograd's
        hold on the save: a branch of the graph that dies in forward releases it (`drop_released_saves`).
        An object holding the tensor itself would hold a saved output's grad_fn in a cycle that is
        never collected."""
        record = self.current
        if record is None or self.tracker is None:
            return tensor
        name = self.on_pack(record, tensor)
        with _disable_current_modes():  # not an operator of the node: the counters must not see it
            alias = tensor.detach()
        self.saved.append((record, name, weakref.ref(alias)))
        return alias

    def on_pack(self, record: NodeRecord, tensor: torch.Tensor) -> str | None:
        """Record that `record` saves `tensor`; its activation storage's name (None if static)."""
        assert self.tracker is not None
        record.saves_anything = True
        record.last_pack_peak_bytes = self.tracker.peak_bytes
        name = self.tracker.name_of(tensor, create=True)
        if name is None:
            return None
        if name not in record.saves:
            record.saves.append(name)
        if name not in self.created:
            self.created.add(name)
            record.creates.append(name)
        return name

    def drop_released_saves(self) -> None:
        """Forget saves that autograd released in forward: those of a branch of the graph that no
        output depends on (`if y.abs().max() > t:` saves `y` and `y.abs()` until the comparison)."""
        held: set[tuple[str, str | None]] = set()
        for record, name, saved in self.saved:
            if saved() is not None:
                held.add((record.name, name))
        for record in self.records.values():
            record.saves = [name for name in record.saves if (record.name, name) in held]
            record.saves_anything = record.saves_anything and any(key[0] == record.name for key in held)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_module", "call_function", "call_method"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        versions = {id(t): t._version for t in tensors_in((args, kwargs))}
        meters = Meters(counting=self.tracker is not None)
        units = self.split_units.get(str(n.target), ()) if n.op == "call_module" else ()
        with meters:
            if units:
                split = SplitCall(self, n, units, meters)
                output = split.run(args, kwargs)
                record = split.parts[-1]
            else:
                record = self._record(n)
                self.start_node(record)
                started = time.perf_counter()
                output = getattr(self, n.op)(n.target, args, kwargs)
                self.forward_ms[n.name] = (time.perf_counter() - started) * 1e3
                meters.charge(record, (args, kwargs), output)
                self.finish_node(record, (args, kwargs), output)
        if self.tracker is not None:
            written = [t for t in tensors_in((args, kwargs)) if t._version != versions[id(t)]]
            names = (self.tracker.name_of(t, create=False) for t in written)
            record.mutates = list(dict.fromkeys(name for name in names if name is not None))
        return output

    def _record(self, n: fx.Node) -> NodeRecord:
        op, module_path = _describe(n, self.module)  # type: ignore[arg-type]
        return NodeRecord(
            name=n.name,
            op=op,
            module_path=module_path,
            inputs=tuple(str(a) for a in n.all_input_nodes),
            buffer_bytes=_buffer_bytes(n, self.module),  # type: ignore[arg-type]
            **_flags(n, self.module),  # type: ignore[arg-type]
        )


@contextmanager
def preserved_state(model: torch.nn.Module) -> Iterator[None]:
    """Restore RNG state and buffers (BatchNorm statistics) after profiling."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with _rng_replayed():
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def _grad_targets(model: torch.nn.Module, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    targets: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    targets += [t for t in tensors_in(inputs) if t.requires_grad]
    return targets


@dataclass
class _BackwardClock:
    """Segments backward into per-node intervals opened by grad_fn pre-hooks."""

    interpreter: _ProfilingInterpreter
    tracker: ProfilingTracker | None
    current: str | None = None
    opened_at: float = 0.0
    backward_ms: dict[str, float] = field(default_factory=dict)
    unpacked: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    """The saved tensors unpacked so far, by id (NOTE [unpacked twice])."""

    def open(self, name: str) -> None:
        self.close()
        if self.tracker is not None:
            self.tracker.reset_peak()
        self.current = name
        self.opened_at = time.perf_counter()

    def unpack(self, saved: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks unpack hook: note the live bytes at the node's first unpack.

        NOTE [unpacked twice]: non-reentrant checkpoint hands a replayed tensor to autograd once and
        raises `CheckpointError` when a backward unpacks it again (a custom autograd Function that
        reads `ctx.saved_tensors` twice), so a node whose backward does is not checkpointable: a plan
        checkpointing it would fail in its first backward."""
        if self.current is not None and self.tracker is not None:
            record = self.interpreter.records[self.current]
            if record.unpack_live_bytes is None:
                record.unpack_live_bytes = self.tracker.live_bytes
            earlier = self.unpacked.get(id(saved))
            if earlier is not None and earlier() is saved:
                record.checkpointable = False
            self.unpacked[id(saved)] = weakref.ref(saved)
        return saved

    def close(self) -> None:
        if self.current is None:
            return
        record = self.interpreter.records[self.current]
        self.backward_ms[self.current] = (
            self.backward_ms.get(self.current, 0.0) + (time.perf_counter() - self.opened_at) * 1e3
        )
        if self.tracker is not None:
            peak_bytes = self.tracker.peak_bytes + self.tracker.library_workspace_bytes()
            record.backward_peak_bytes = max(record.backward_peak_bytes or 0, peak_bytes)
            self.tracker.reset_peak()
        self.current = None


def _profile_step(
    graph_module: fx.GraphModule,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    targets: list[torch.Tensor],
    tracker: ProfilingTracker | None,
    split_units: Mapping[str, tuple[str, ...]],
    *,
    release_on_unpack: bool = False,
) -> tuple[_ProfilingInterpreter, _BackwardClock]:
    """One step through the interpreter; with `release_on_unpack`, every saved tensor is freed once its
    backward formula is done with it, as checkpoint frees a replay's (NOTE [replay's early frees])."""
    start_autocast_forward()  # see NOTE [autocast] in measurement.py
    interpreter = _ProfilingInterpreter(graph_module, tracker, split_units)
    clock = _BackwardClock(interpreter, tracker)
    hooks = []
    pack: Callable[[torch.Tensor], Any] = interpreter.pack
    unpack: Callable[[Any], torch.Tensor] = clock.unpack
    if release_on_unpack:
        pack = lambda tensor: ReleasedOnUnpack(interpreter.pack(tensor))  # noqa: E731
        unpack = lambda held: clock.unpack(held.take())  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output = interpreter.run(*inputs)
        interpreter.env.clear()  # the interpreter keeps the output node's value; the model does not
        loss_record = NodeRecord(
            name=LOSS_NODE, op="loss_fn", module_path="", inputs=(), checkpointable=False
        )
        interpreter.start_node(loss_record)
        started = time.perf_counter()
        loss = loss_fn(output)
        interpreter.forward_ms[LOSS_NODE] = (time.perf_counter() - started) * 1e3
        interpreter.finish_node(loss_record, output, loss)
        del output
        end_autocast_forward()  # see NOTE [autocast] in measurement.py
    interpreter.drop_released_saves()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
        raise ValueError(
            "loss_fn must return a scalar tensor that requires grad; got "
            f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}. Check that the model has "
            "trainable parameters and that loss_fn uses the model's output."
        )
    for grad_fn in interpreter.hooked_grad_fns:
        owner = interpreter.grad_fn_owner[id(grad_fn)]
        hooks.append(grad_fn.register_prehook(lambda _grads, owner=owner: clock.open(owner)))
    interpreter.hooked_grad_fns = []

    def on_gradient(target: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(gradient: torch.Tensor) -> None:
            if clock.current is not None:
                interpreter.records[clock.current].parameter_gradient_bytes += counted_bytes(
                    storage_of(gradient).nbytes()
                )

        return hook

    hooks += [target.register_hook(on_gradient(target)) for target in targets]
    try:
        gradients = torch.autograd.grad(loss, targets, allow_unused=True)
        clock.close()
    finally:
        for hook in hooks:
            hook.remove()
    del gradients, loss
    return interpreter, clock


def _measuring_tracker(
    model: torch.nn.Module, inputs: tuple[Any, ...], graph_module: fx.GraphModule
) -> ProfilingTracker:
    """A tracker for a measuring step, counting the model's resident tensors from its start."""
    tracker = ProfilingTracker()
    step_device = device_of(model, inputs)
    tracker.cuda_device = step_device if step_device.type == "cuda" else None
    static_tensors = [*model.parameters(), *model.buffers(), *tensors_in(inputs)]
    static_tensors += extra_static_tensors(graph_module)
    tracker.track(static_tensors)
    tracker.static_keys = {id(storage_of(t)) for t in static_tensors}
    return tracker


@contextmanager
def _rng_replayed() -> Iterator[None]:
    """The random state restored after the block, Python's and NumPy's generators with torch's: a second
    measuring step draws the same numbers (a layer that skips itself when `random.random()` says so
    skips in both or in neither: NOTE [Python draws] in capture/kept_whole.py), and profiling leaves the
    user's streams where they were."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), drawing_generators_restored():
        yield


def _measure_released_peaks(
    interpreter: _ProfilingInterpreter,
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    targets: list[torch.Tensor],
    split: Mapping[str, tuple[str, ...]],
    spec: DeviceSpec | None,
) -> None:
    """Each node's backward peak in a second measuring step that frees saved tensors on unpack (NOTE
    [replay's early frees] in calibration.py), into the first step's records. A backward that unpacks
    a saved tensor again after freeing it cannot be measured so (NOTE [unpacked twice]): then every
    node keeps its whole backward peak, an upper bound."""
    graph_module = interpreter.module
    assert isinstance(graph_module, fx.GraphModule)
    tracker = _measuring_tracker(model, inputs, graph_module)
    try:
        with tracker, _attention_on_meta(model, inputs, spec):
            released, _ = _profile_step(
                graph_module, inputs, loss_fn, targets, tracker, split, release_on_unpack=True
            )
    except UnpackedAgain as error:
        log.info("%s (NOTE [unpacked twice]): replayed nodes keep their whole backward peaks", error)
        return
    for name, record in interpreter.records.items():
        again = released.records.get(name)
        if again is not None:
            record.released_backward_peak_bytes = again.backward_peak_bytes


def _to_nodes(
    interpreter: _ProfilingInterpreter, forward_ms: dict[str, float], backward_ms: dict[str, float]
) -> list[Node]:
    nodes = []
    replayed = interpreter.tracker.replayed_names if interpreter.tracker is not None else set()
    for name in interpreter.order:
        record = interpreter.records[name]
        nodes.append(
            Node(
                name=record.name,
                op=record.op,
                module_path=record.module_path,
                inputs=record.inputs,
                creates=tuple(record.creates),
                reads=tuple(record.reads),
                saves=tuple(record.saves),
                saves_anything=record.saves_anything,
                forward_ms=forward_ms.get(name, 0.0),
                backward_ms=backward_ms.get(name, 0.0),
                forward_workspace_bytes=0,
                backward_workspace_bytes=0,
                parameter_gradient_bytes=record.parameter_gradient_bytes,
                keep_cache_bytes=record.keep_cache_bytes,
                buffer_bytes=record.buffer_bytes,
                replayed_when_kept=tuple(name for name in record.creates if name in replayed),
                forward_flops=record.forward_flops,
                moved_bytes=record.moved_bytes,
                operator_count=record.operator_count,
                random=record.random,
                draws_python=record.draws_python,
                stateful=record.stateful,
                in_place=record.in_place,
                checkpointable=record.checkpointable,
                part_of=record.part_of,
            )
        )
    return nodes


def build_activation_graph(
    captured: Capture,
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    *,
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: OptimizerSpec,
    step: TrainingStep | None = None,
    cost_model: CostModel = CostModel.MEASURED,
    device: str | DeviceSpec | None = None,
    memory_counting: MemoryCounting = MemoryCounting.BLOCKS,
) -> ActivationGraph:
    """Profile one training step of `captured` and return its activation graph (model left unchanged),
    every byte in it counted as `memory_counting` says (NOTE [counted bytes] in ir.py).

    `cost_model="measured"` times each node in repeated profiling steps on the model's device;
    `"analytic"` prices it by FLOPs and bytes on `device` (see cost_model.py) and needs no timing run,
    which is the only choice for a model on the meta device. The graph describes one micro-batch that
    starts with no gradient; its static bytes include the end of `step` (clipping, unscaling, the
    optimizer step), and `for_training_step` (simulation/micro_batches.py) applies the rest of `step`.
    """
    with counting_scope(MemoryCounting(memory_counting)):
        return _profiled_graph(captured, model, inputs, loss_fn, optimizer, step, cost_model, device)


def _profiled_graph(
    captured: Capture,
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: OptimizerSpec,
    step: TrainingStep | None,
    cost_model: CostModel,
    device: str | DeviceSpec | None,
) -> ActivationGraph:
    """`build_activation_graph` inside its counting scope (NOTE [counting scope] in counting.py)."""
    graph_module = captured.graph_module
    spec = cost_spec(model, inputs, cost_model, device)
    targets = _grad_targets(model, inputs)
    if not targets:
        raise ValueError(
            "nothing to train: no parameter of the model and no input requires grad; "
            "checkpointing only matters for training steps"
        )
    with preserved_state(model):
        split = static_units(graph_module, inputs, captured)
        tracker = _measuring_tracker(model, inputs, graph_module)
        with _rng_replayed(), tracker, _attention_on_meta(model, inputs, spec):
            interpreter, _ = _profile_step(graph_module, inputs, loss_fn, targets, tracker, split)
        _measure_released_peaks(interpreter, model, inputs, loss_fn, targets, split, spec)
        forbid_replaying_mutated_inputs([interpreter.records[name] for name in interpreter.order])
        if spec is None:
            forward_ms, backward_ms = _measured_times(
                graph_module, inputs, loss_fn, targets, interpreter.order, split
            )
    if spec is not None:
        forward_ms = {
            name: analytic_forward_ms(record.forward_flops, record.moved_bytes, spec, random=record.random)
            for name, record in interpreter.records.items()
        }
        backward_ms = {name: BACKWARD_FACTOR * time_ms for name, time_ms in forward_ms.items()}
    gradient_bytes = sum(record.parameter_gradient_bytes for record in interpreter.records.values())
    static = static_bytes(
        model,
        inputs,
        gradient_bytes=gradient_bytes,
        optimizer=optimizer,
        step=step,
        device_type=None if spec is None else spec.device_type,
    )
    static = dataclasses.replace(
        static, buffer_bytes=static.buffer_bytes + constant_bytes(graph_module, model)
    )
    optimizer_label = optimizer_name(optimizer)
    prices = checkpoint_cost(model, inputs, spec)
    profiled = ActivationGraph(
        nodes=tuple(_to_nodes(interpreter, forward_ms, backward_ms)),
        storage_bytes=dict(tracker.storage_bytes),
        static=dataclasses.replace(static, optimizer_state_bytes=0),
        capture=captured.label(split),
        optimizer=optimizer_label,
        timing=CostModel.MEASURED.value if spec is None else f"{CostModel.ANALYTIC.value} ({spec.name})",
        selective_op_overhead_ms=selective_op_overhead_ms(model, inputs, spec),
        checkpoint_call_ms=prices.call_ms,
        checkpoint_op_ms=prices.per_operator_ms,
        memory_counting=current_counting(),
    )
    calibrated = calibrate_workspace(profiled, interpreter.records)
    return dataclasses.replace(calibrated, static=static)


def _attention_on_meta(
    model: torch.nn.Module, inputs: tuple[Any, ...], spec: DeviceSpec | None
) -> contextlib.AbstractContextManager[Any]:
    """On the meta device, attention runs the kernel `spec`'s device would (attention.py)."""
    if spec is None or not any(t.is_meta for t in [*model.parameters(), *tensors_in(inputs)]):
        return nullcontext()
    return planned_attention(spec)


def _measured_times(
    graph_module: fx.GraphModule,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    targets: list[torch.Tensor],
    order: list[str],
    split_units: Mapping[str, tuple[str, ...]],
) -> tuple[dict[str, float], dict[str, float]]:
    """Fastest per-node forward and backward times of `TIMING_REPEATS` untracked profiling steps."""
    forward_runs, backward_runs = [], []
    for _ in range(TIMING_REPEATS):
        timed, clock = _profile_step(graph_module, inputs, loss_fn, targets, None, split_units)
        forward_runs.append(timed.forward_ms)
        backward_runs.append(clock.backward_ms)
    forward_ms = {name: min(run.get(name, 0.0) for run in forward_runs) for name in order}
    backward_ms = {name: min(run.get(name, 0.0) for run in backward_runs) for name in order}
    return forward_ms, backward_ms
