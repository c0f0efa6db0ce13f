"""Runs one profiling training step through the captured graph and records an ActivationGraph.

Memory is measured, not inferred from shapes: a `LiveStorageTracker` counts storages, and
`torch.autograd.graph.saved_tensors_hooks` reports what autograd really keeps for each node (a Linear
its input, a ReLU its output, a view nothing new), attributed to storages so that a tensor saved by
two nodes counts once. Backward is segmented per node by pre-hooks on each node's `grad_fn`; autograd
on one device runs nodes in reverse creation order, which is the graph's reverse execution order.

The profiling step leaves the model as it found it: gradients go to `torch.autograd.grad` instead of
`.grad`, and the RNG state and every buffer (BatchNorm statistics) are restored afterwards.

Residuals are calibrated against the simulator itself (see NOTE [measured residuals] in ir.py): the
activation memory the simulator predicts without checkpointing is subtracted from the measured peak at
each node, so what remains is what no schedule changes.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from planner.capture import Capture, has_hooks
from planner.cost_model import BACKWARD_FACTOR, DeviceSpec, analytic_forward_ms, device_spec
from planner.ir import ActivationGraph, Node, Phase, TrainingStep
from planner.measurement import (
    LiveStorageTracker,
    OptimizerSpec,
    end_autocast_forward,
    tensors_in,
)
from planner.selective_cost import OperatorCounter, measure_selective_op_overhead_ms
from planner.simulate import simulate, store_everything
from planner.static_memory import constant_bytes, extra_static_tensors, optimizer_name, static_bytes

__all__ = ["build_activation_graph", "LOSS_NODE"]

LOSS_NODE = "loss"
TIMING_REPEATS = 3
"""Timed profiling steps after the measuring one; per-node times are their minimums. Timing noise on a
shared machine only ever adds time (preemption, cache misses from other jobs), so the fastest run is the
best estimate of a node's own cost; a median of three still carries any noise two runs share."""

RANDOM_MODULES = (torch.nn.modules.dropout._DropoutNd,)
RANDOM_FUNCTIONS = {
    torch.nn.functional.dropout,
    torch.nn.functional.dropout1d,
    torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d,
    torch.nn.functional.alpha_dropout,
    torch.bernoulli,
    torch.rand,
    torch.randn,
    torch.rand_like,
    torch.randn_like,
}


@dataclass
class _NodeRecord:
    """What the measuring step learned about one node."""

    name: str
    op: str
    module_path: str
    inputs: tuple[str, ...]
    creates: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)
    saves_anything: bool = False
    forward_peak_bytes: int = 0
    backward_peak_bytes: int | None = None
    unpack_live_bytes: int | None = None
    """Live bytes when the node's backward first unpacks a saved tensor (where a replay would run)."""
    parameter_gradient_bytes: int = 0
    allocated_bytes: int = 0
    forward_flops: int = 0
    moved_bytes: int = 0
    operator_count: int = 1
    random: bool = False
    stateful: bool = False
    in_place: bool = False
    checkpointable: bool = True
    mutates: list[str] = field(default_factory=list)
    """Activation storages among the node's inputs that it wrote in place (their version moved)."""


class _ProfilingTracker(LiveStorageTracker):
    """A storage tracker that also names activation storages and remembers which are new."""

    def __init__(self) -> None:
        super().__init__()
        self.static_keys: set[int] = set()
        self.names: dict[int, str] = {}
        self.storage_bytes: dict[str, int] = {}
        self.new_since_mark: list[weakref.ref[torch.UntypedStorage]] = []
        self.allocated_since_mark_bytes = 0

    def _register(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        fresh = id(storage) not in self._tracked and storage.nbytes() > 0
        super()._register(tensor)
        if fresh:
            self.new_since_mark.append(weakref.ref(storage))
            self.allocated_since_mark_bytes += storage.nbytes()

    def name_of(self, tensor: torch.Tensor, *, create: bool) -> str | None:
        """Name of an activation storage (None for static ones); `create` names a new storage."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.static_keys or storage.nbytes() == 0:
            return None
        if key not in self.names:
            if not create:
                return None
            name = f"s{len(self.storage_bytes)}"
            self.names[key] = name
            self.storage_bytes[name] = storage.nbytes()
            weakref.finalize(storage, self.names.pop, key, None)
        return self.names[key]

    def fresh_storage_ids(self) -> set[int]:
        """Storages registered since the last call that are still alive."""
        alive = {id(storage) for ref in self.new_since_mark if (storage := ref()) is not None}
        self.new_since_mark = []
        self.allocated_since_mark_bytes = 0
        return alive


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


def _flags(node: fx.Node, graph_module: fx.GraphModule) -> dict[str, bool]:
    if node.op == "call_module":
        module = graph_module.get_submodule(str(node.target))
        return {
            "random": isinstance(module, RANDOM_MODULES),
            "stateful": any(True for _ in module.buffers()),
            "in_place": bool(getattr(module, "inplace", False)),
            "checkpointable": not has_hooks(module),  # a replay would run its hooks twice
        }
    target_name = getattr(node.target, "__name__", str(node.target))
    schema = getattr(node.target, "_schema", None)  # ATen operators (torch.export graphs)
    return {
        "random": node.target in RANDOM_FUNCTIONS or _draws_random_numbers(node),
        "stateful": False,
        "in_place": bool(node.kwargs.get("inplace", False))
        or (node.op == "call_method" and target_name.endswith("_"))
        or (schema is not None and schema.is_mutable),
    }


def _draws_random_numbers(node: fx.Node) -> bool:
    """An ATen operator tagged as seeded (dropout, bernoulli, ...); attention only with dropout_p > 0."""
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    schema = node.target._schema  # type: ignore[union-attr]
    names = [argument.name for argument in schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    dropout_p = node.args[position] if len(node.args) > position else node.kwargs.get("dropout_p", 0.0)
    return not isinstance(dropout_p, int | float) or dropout_p > 0


class _ProfilingInterpreter(fx.Interpreter):
    """Runs the graph node by node, attributing memory, saved tensors and grad_fns to FX nodes."""

    def __init__(self, graph_module: fx.GraphModule, tracker: _ProfilingTracker | None) -> None:
        super().__init__(graph_module)
        self.tracker = tracker
        self.records: dict[str, _NodeRecord] = {}
        self.order: list[str] = []
        self.forward_ms: dict[str, float] = {}
        self.grad_fn_owner: dict[int, str] = {}
        self.hooked_grad_fns: list[Any] = []
        self.current: _NodeRecord | None = None
        self.created: set[str] = set()

    def start_node(self, record: _NodeRecord) -> None:
        self.records[record.name] = record
        self.order.append(record.name)
        self.current = record
        if self.tracker is not None:
            self.tracker.fresh_storage_ids()
            self.tracker.reset_peak()

    def finish_node(self, record: _NodeRecord, args: Any, output: Any) -> None:
        tracker = self.tracker
        if tracker is not None:
            record.forward_peak_bytes = tracker.peak_bytes
            record.allocated_bytes = tracker.allocated_since_mark_bytes
            fresh = tracker.fresh_storage_ids()
            for tensor in tensors_in(output):
                if id(tensor.untyped_storage()) in fresh:
                    name = tracker.name_of(tensor, create=True)
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
        """saved_tensors_hooks pack hook: record the saved tensor, keep it as autograd would."""
        self.on_pack(tensor)
        return tensor

    def on_pack(self, tensor: torch.Tensor) -> None:
        record = self.current
        if record is None or self.tracker is None:
            return
        record.saves_anything = True
        name = self.tracker.name_of(tensor, create=True)
        if name is None:
            return
        if name not in record.saves:
            record.saves.append(name)
        if name not in self.created:
            self.created.add(name)
            record.creates.append(name)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_module", "call_function", "call_method"):
            return super().run_node(n)
        op, module_path = _describe(n, self.module)  # type: ignore[arg-type]
        record = _NodeRecord(
            name=n.name,
            op=op,
            module_path=module_path,
            inputs=tuple(str(a) for a in n.all_input_nodes),
            **_flags(n, self.module),  # type: ignore[arg-type]
        )
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        versions = {id(t): t._version for t in tensors_in((args, kwargs))}
        self.start_node(record)
        counter = FlopCounterMode(display=False) if self.tracker is not None else None
        operators = OperatorCounter()
        started = time.perf_counter()
        with (
            counter if counter is not None else nullcontext(),
            operators if counter is not None else nullcontext(),
        ):
            output = getattr(self, n.op)(n.target, args, kwargs)
        self.forward_ms[n.name] = (time.perf_counter() - started) * 1e3
        if counter is not None:
            record.forward_flops = counter.get_total_flops()
            record.operator_count = max(1, operators.count)
            record.moved_bytes = _moved_bytes((args, kwargs), output)
        self.finish_node(record, (args, kwargs), output)
        if self.tracker is not None:
            written = [t for t in tensors_in((args, kwargs)) if t._version != versions[id(t)]]
            names = (self.tracker.name_of(t, create=False) for t in written)
            record.mutates = list(dict.fromkeys(name for name in names if name is not None))
        return output


def _tensor_bytes(value: Any) -> int:
    """Bytes a node reads or writes: each tensor's own elements, views included."""
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def _moved_bytes(inputs: Any, output: Any) -> int:
    """Bytes a node reads and writes; none when every output is a view of an input (a view moves
    metadata only). Views are recognised by their base, which works on the meta device too."""
    bases = {id(t._base if t._base is not None else t) for t in tensors_in(inputs)}
    outputs = tensors_in(output)
    if outputs and all(t._base is not None and id(t._base) in bases for t in outputs):
        return 0
    return _tensor_bytes(inputs) + _tensor_bytes(output)


@contextmanager
def _preserved_state(model: torch.nn.Module) -> Iterator[None]:
    """Restore RNG state and buffers (BatchNorm statistics) after profiling."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
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
    tracker: LiveStorageTracker | None
    current: str | None = None
    opened_at: float = 0.0
    backward_ms: dict[str, float] = field(default_factory=dict)

    def open(self, name: str) -> None:
        self.close()
        if self.tracker is not None:
            self.tracker.reset_peak()
        self.current = name
        self.opened_at = time.perf_counter()

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks unpack hook: note the live bytes at the node's first unpack."""
        if self.current is not None and self.tracker is not None:
            record = self.interpreter.records[self.current]
            if record.unpack_live_bytes is None:
                record.unpack_live_bytes = self.tracker.live_bytes
        return tensor

    def close(self) -> None:
        if self.current is None:
            return
        record = self.interpreter.records[self.current]
        self.backward_ms[self.current] = (
            self.backward_ms.get(self.current, 0.0) + (time.perf_counter() - self.opened_at) * 1e3
        )
        if self.tracker is not None:
            record.backward_peak_bytes = max(record.backward_peak_bytes or 0, self.tracker.peak_bytes)
            self.tracker.reset_peak()
        self.current = None


def _profile_step(
    graph_module: fx.GraphModule,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    targets: list[torch.Tensor],
    tracker: _ProfilingTracker | None,
) -> tuple[_ProfilingInterpreter, _BackwardClock]:
    interpreter = _ProfilingInterpreter(graph_module, tracker)
    clock = _BackwardClock(interpreter, tracker)
    hooks = []
    with torch.autograd.graph.saved_tensors_hooks(interpreter.pack, clock.unpack):
        output = interpreter.run(*inputs)
        interpreter.env.clear()  # the interpreter keeps the output node's value; the model does not
        loss_record = _NodeRecord(
            name=LOSS_NODE, op="loss_fn", module_path="", inputs=(), checkpointable=False
        )
        interpreter.start_node(loss_record)
        started = time.perf_counter()
        loss = loss_fn(output)
        interpreter.forward_ms[LOSS_NODE] = (time.perf_counter() - started) * 1e3
        interpreter.finish_node(loss_record, output, loss)
        del output
        end_autocast_forward()  # see NOTE [autocast] in measurement.py
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
                interpreter.records[
                    clock.current
                ].parameter_gradient_bytes += gradient.untyped_storage().nbytes()

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


def _to_nodes(
    interpreter: _ProfilingInterpreter, forward_ms: dict[str, float], backward_ms: dict[str, float]
) -> list[Node]:
    nodes = []
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
                allocated_bytes=record.allocated_bytes,
                forward_flops=record.forward_flops,
                moved_bytes=record.moved_bytes,
                operator_count=record.operator_count,
                random=record.random,
                stateful=record.stateful,
                in_place=record.in_place,
                checkpointable=record.checkpointable,
            )
        )
    return nodes


def _calibrate(graph: ActivationGraph, records: dict[str, _NodeRecord]) -> ActivationGraph:
    """Set each node's workspace to measured peak minus the simulator's prediction without them."""
    trace = simulate(graph, store_everything(graph)).trace
    forward_predicted = {step.node: step.live_bytes for step in trace if step.phase is Phase.FORWARD}
    backward_predicted = {step.node: step.live_bytes for step in trace if step.phase is Phase.BACKWARD}
    calibrated = []
    for node in graph.nodes:
        record = records[node.name]
        forward_workspace = max(0, record.forward_peak_bytes - forward_predicted[node.name])
        backward_workspace = 0
        if record.backward_peak_bytes is not None:
            backward_workspace = max(0, record.backward_peak_bytes - backward_predicted[node.name])
        replay_workspace = None
        if record.unpack_live_bytes is not None:
            # The node's own parameter gradients are not made yet when it unpacks (nor in the replay).
            before_node = backward_predicted[node.name] - node.parameter_gradient_bytes
            replay_workspace = max(0, record.unpack_live_bytes - before_node)
        calibrated.append(
            dataclasses.replace(
                node,
                forward_workspace_bytes=forward_workspace,
                backward_workspace_bytes=backward_workspace,
                replay_workspace_bytes=replay_workspace,
            )
        )
    return dataclasses.replace(graph, nodes=tuple(calibrated))


def build_activation_graph(
    captured: Capture,
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    *,
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: OptimizerSpec,
    step: TrainingStep | None = None,
    cost_model: str = "measured",
    device: str | DeviceSpec | None = None,
) -> ActivationGraph:
    """Profile one training step of `captured` and return its activation graph (model left unchanged).

    `cost_model="measured"` times each node in repeated profiling steps on the model's device;
    `"analytic"` prices it by FLOPs and bytes on `device` (see cost_model.py) and needs no timing run,
    which is the only choice for a model on the meta device. The graph describes one micro-batch that
    starts with no gradient; its static bytes include the end of `step` (clipping, unscaling, the
    optimizer step), and `simulate.for_training_step` applies the rest of `step`.
    """
    graph_module = captured.graph_module
    spec = _cost_spec(model, inputs, cost_model, device)
    targets = _grad_targets(model, inputs)
    if not targets:
        raise ValueError(
            "nothing to train: no parameter of the model and no input requires grad; "
            "checkpointing only matters for training steps"
        )
    with _preserved_state(model):
        tracker = _ProfilingTracker()
        static_tensors = [*model.parameters(), *model.buffers(), *tensors_in(inputs)]
        static_tensors += extra_static_tensors(graph_module)
        tracker.track(static_tensors)
        tracker.static_keys = {id(t.untyped_storage()) for t in static_tensors}
        with tracker:
            interpreter, _ = _profile_step(graph_module, inputs, loss_fn, targets, tracker)
        _forbid_replaying_mutated_inputs(interpreter)
        if spec is None:
            forward_ms, backward_ms = _measured_times(
                graph_module, inputs, loss_fn, targets, interpreter.order
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
    profiled = ActivationGraph(
        nodes=tuple(_to_nodes(interpreter, forward_ms, backward_ms)),
        storage_bytes=dict(tracker.storage_bytes),
        static=dataclasses.replace(static, optimizer_state_bytes=0),
        capture=captured.path,
        optimizer=optimizer_label,
        timing="measured" if spec is None else f"analytic ({spec.name})",
        selective_op_overhead_ms=_selective_op_overhead_ms(model, inputs, spec),
    )
    calibrated = _calibrate(profiled, interpreter.records)
    return dataclasses.replace(calibrated, static=static)


def _selective_op_overhead_ms(
    model: torch.nn.Module, inputs: tuple[Any, ...], spec: DeviceSpec | None
) -> float:
    """The spec's estimate for analytic times, else measured on the device of the model's tensors."""
    if spec is not None:
        return spec.selective_op_overhead_ms
    tensors = [*model.parameters(), *tensors_in(inputs)]
    return measure_selective_op_overhead_ms(tensors[0].device if tensors else torch.device("cpu"))


def _forbid_replaying_mutated_inputs(interpreter: _ProfilingInterpreter) -> None:
    """Mark not checkpointable every node that reads a storage before an in-place write to it.

    A checkpointed region keeps its input storages to replay itself, and refuses to replay from one
    that was written in place since (autograd's version check). A region that starts after storage
    S was made and contains a node reading S has S as an input; if S is written at or after that
    node, the replay fails. So every reader of S between S's creator (exclusive) and its last
    in-place writer (inclusive) stays out of checkpointed regions. capture.py runs the common
    in-place ops out of place where that is safe, so this rarely applies.
    """
    records = [interpreter.records[name] for name in interpreter.order]
    created_at = {storage: index for index, record in enumerate(records) for storage in record.creates}
    for writer_index, writer in enumerate(records):
        for storage in writer.mutates:
            start = created_at.get(storage, -1) + 1
            for record in records[start : writer_index + 1]:
                if storage in record.reads or storage in record.saves:
                    record.checkpointable = False


def _cost_spec(
    model: torch.nn.Module, inputs: tuple[Any, ...], cost_model: str, device: str | DeviceSpec | None
) -> DeviceSpec | None:
    """The device spec of the analytic cost model, or None to measure times."""
    on_meta = any(t.is_meta for t in [*model.parameters(), *tensors_in(inputs)])
    if cost_model == "measured":
        if on_meta:
            raise ValueError(
                "a model on the meta device cannot be timed; pass cost_model='analytic' and the "
                "device to plan for, e.g. device='h100'"
            )
        return None
    if cost_model != "analytic":
        raise ValueError(f"cost_model={cost_model!r} is not known; use 'measured' or 'analytic'")
    if device is None:
        raise ValueError("cost_model='analytic' needs device= (one of 'h100', 'a100', 'cpu' or a DeviceSpec)")
    return device_spec(device)


def _measured_times(
    graph_module: fx.GraphModule,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    targets: list[torch.Tensor],
    order: list[str],
) -> tuple[dict[str, float], dict[str, float]]:
    """Fastest per-node forward and backward times of `TIMING_REPEATS` untracked profiling steps."""
    forward_runs, backward_runs = [], []
    for _ in range(TIMING_REPEATS):
        timed, clock = _profile_step(graph_module, inputs, loss_fn, targets, None)
        forward_runs.append(timed.forward_ms)
        backward_runs.append(clock.backward_ms)
    forward_ms = {name: min(run.get(name, 0.0) for run in forward_runs) for name in order}
    backward_ms = {name: min(run.get(name, 0.0) for run in backward_runs) for name in order}
    return forward_ms, backward_ms
