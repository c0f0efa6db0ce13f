"""`optimize(..., compile=True)`: plan the step `torch.compile` runs, and install the plan in inductor.

An eager plan translated to a compiled model plans the wrong graph: inductor fuses operators, keeps
fewer intermediates and recomputes cheap ones on its own, so the compiled step's memory differs from
the eager step's in both directions. Here the planner plans the compiled step itself:

1. The model is compiled with inductor and a partitioner of ours (`custom_partitioner_fn`, inductor's
   public hook). When AOT autograd hands it the joint forward-backward graph, the partitioner builds
   the planner's ActivationGraph of it (compiled_graph.py), adds the whole step's static memory
   (parameters, gradients, optimizer state: static_memory.py) and the loss, measured eagerly, and
   solves it with the planner's own solvers under the byte budget.
2. The schedule becomes the set of values the forward saves (a checkpointed region keeps its inputs,
   its backward recomputes the rest; random draws are always saved, so recomputed dropout replays its
   mask: NOTE [random operators] in compiled_graph.py). inductor's min-cut partitioner then builds the
   forward and backward graphs around that set, and the backward runs in the planned order.
3. One forward and backward on the example inputs compiles both graphs; the model's state is left as
   it was (gradients go to `torch.autograd.grad`, RNG state and buffers are restored).

NOTE [graph breaks]: a model dynamo splits into several graphs whose backward is needed (data-dependent
control flow, a log call in the forward) cannot be planned as one step: each graph would be planned
alone under the whole budget. `optimize` refuses it (`UnsupportedModel`, with dynamo's reasons) once
it sees a second such graph, and `plan_compiled_step` asks `torch._dynamo.explain` first. A log call is
the common case (Hugging Face's GPT-2 warns once from its loss): while `optimize` compiles, dynamo skips
the `logging.Logger` methods (`ignore_logger_methods`), so the message is not logged from the compiled
step; a recompile later (another shape) runs under the caller's own dynamo settings. Shapes are static
(`dynamic=False`): a call with other shapes recompiles, and that graph is planned on its own.

NOTE [partitioner hook]: torch 2.13 offers two hooks. `activation_memory_budget_solver` takes a
`CustomKnapsackSolver`, but it only chooses which of the min-cut's *banned* nodes may be recomputed,
at a budget given as a fraction, and the min-cut then decides the saved set: it cannot install a
saved set. `torch._inductor.config.custom_partitioner_fn` replaces the partitioner. Ours calls
`min_cut_rematerialization_partition` itself (so CSE, RNG functionalization, symbolic sizes and
mutations are handled as inductor handles them) with its one decision, `choose_saved_values_set`,
substituted for the duration of the call. That substitution is the only use of a private name; a
torch without it raises `UnsupportedModel` saying so.

NOTE [buffer pool]: inductor's generated code keeps a dead buffer allocated until a later buffer of the
same size and dtype takes it over (`allow_buffer_reuse`), which saves an allocation but holds memory
between the two: in a backward that recomputes, the replayed blocks' buffers stay allocated while the
blocks after them run, and the peak rises above what the program's liveness needs. The planner turns
that pool off for its compile (buffers are freed when they die; a kernel still writes its output
into a dying input's buffer, `inplace_buffers`), so that memory is the liveness it predicts.

NOTE [backward order]: inductor reorders each graph for peak memory (`reorder_for_peak_memory`) with
heuristics on its own fused kernels, which the planner cannot predict before they exist. The planner
instead chooses the backward's order itself (the same least-peak-first heuristic on its model of the
kernels, or autograd's order when that is lower: `backward_order` in compiled_graph.py), imposes it
on the partitioned backward, and turns inductor's reordering off for this compile, so that the order
it predicts is the order that runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch._functorch import partitioners
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils._pytree import tree_map

from planner.backward_order import order_backward
from planner.compiled_graph import LossProfile, build_compiled_graph, retained_storages, saved_values
from planner.cost_model import DeviceSpec, device_spec
from planner.errors import InfeasibleBudget, PlannerError, UnsupportedModel, format_bytes
from planner.graph_api import plan_graph
from planner.ir import StaticBytes, TrainingStep
from planner.measurement import (
    AllocatorPhases,
    LiveStorageTracker,
    OptimizerSpec,
    end_autocast_forward,
    storage_bytes,
    tensors_in,
)
from planner.plan import CompiledStep, Plan
from planner.simulate import for_training_step
from planner.static_memory import optimizer_name, static_bytes

__all__ = ["CompiledPlanning", "optimize_compiled", "plan_compiled_step", "profile_loss"]

log = logging.getLogger(__name__)

INDUCTOR_CONFIG = {"reorder_for_peak_memory": False, "allow_buffer_reuse": False, "fx_graph_cache": False}
"""NOTE [backward order] and NOTE [buffer pool]; and no FX-graph cache, whose key cannot tell two
budgets apart."""
SUBSTITUTED = "choose_saved_values_set"
"""The partitioner's decision this module replaces (NOTE [partitioner hook])."""


@dataclass(frozen=True)
class _Request:
    """What the partitioner plans for: the budget and what it counts beside the joint graph."""

    budget_bytes: int
    solver: str
    static: StaticBytes
    loss: LossProfile
    spec: DeviceSpec
    optimizer: str
    step: TrainingStep


@dataclass
class CompiledPlanning(CustomPartitionerFn):
    """inductor's partitioner with the saved set chosen by the planner (NOTE [partitioner hook]).

    Every joint graph it partitions is planned under the request's budget; `plans` holds the plans in
    the order the graphs were compiled, and `planning_s` the seconds spent planning them.
    """

    request: _Request
    plans: list[Plan] = field(default_factory=list)
    planning_s: float = 0.0
    plan_only: bool = False
    """Stop the compile once the plan is made (`plan_compiled_step`): nothing is generated or compiled."""

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        chosen: dict[str, Any] = {}
        default_choice = getattr(partitioners, SUBSTITUTED, None)
        if default_choice is None:
            raise UnsupportedModel(
                f"torch {torch.__version__} has no torch._functorch.partitioners.{SUBSTITUTED}: planning "
                "the compiled step needs it (NOTE [partitioner hook] in planner/compiled.py); plan the eager "
                "model instead (compile=False) and compile plan.module"
            )

        def choose(joint_graph: torch.fx.Graph, node_info: Any, memory_budget: float = 1.0) -> list[Any]:
            started = time.perf_counter()
            default = default_choice(joint_graph, node_info, 1.0)
            compiled = build_compiled_graph(
                gm,
                node_info,
                default,
                num_fwd_outputs=kwargs["num_fwd_outputs"],
                static=self.request.static,
                loss=self.request.loss,
                spec=self.request.spec,
                optimizer=self.request.optimizer,
            )
            graph = for_training_step(compiled.graph, self.request.step)
            plan = plan_graph(graph, budget_bytes=self.request.budget_bytes, solver=self.request.solver)
            chosen.update(plan=plan, compiled=compiled)
            values = saved_values(compiled, retained_storages(graph, plan.schedule))
            self.planning_s += time.perf_counter() - started
            if self.plan_only:
                self.plans.append(plan)
                raise _PlanOnly
            return values

        with _substituted(partitioners, SUBSTITUTED, choose):
            forward, backward = partitioners.min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.plans.append(chosen["plan"])
        return forward, order_backward(backward, chosen["compiled"].kernel_order)

    def uuid(self) -> Any:
        """Unique to this planning: no inductor cache may hand another budget's partition back."""
        return f"planner.compiled:{id(self)}"

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledPlanning:
        # inductor deep-copies its config (this object among it) to write repro scripts
        return self


class _PlanOnly(Exception):
    """Raised by a `plan_only` partitioner once it has planned, to stop the compile there."""


@contextlib.contextmanager
def _substituted(module: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def _backend(planning: CompiledPlanning) -> Callable[..., Any]:
    """inductor with `planning` as its partitioner, and the settings NOTE [backward order] needs."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(
                graph_module,
                example_inputs,
                config_patches={**INDUCTOR_CONFIG, "custom_partitioner_fn": planning},
            )

    return backend


def profile_loss(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
) -> LossProfile:
    """Measure `loss_fn` as it runs after the compiled forward: eagerly, on an output of the model's
    shapes (zeros; the model is run on fake tensors to learn them, so nothing is computed)."""
    output = _output_like(model, inputs, kwargs)
    leaves = [tensor for tensor in tensors_in(output) if tensor.is_floating_point()]
    tracker = LiveStorageTracker()
    tracker.track(tensors_in(output))
    with tracker:
        before_bytes = tracker.live_bytes
        loss = loss_fn(output)
        end_autocast_forward()
        forward_peak_bytes = tracker.peak_bytes - before_bytes
        saved_bytes = max(0, tracker.live_bytes - before_bytes - loss.untyped_storage().nbytes())
        tracker.reset_peak()
        after_forward_bytes = tracker.live_bytes
        if leaves and loss.requires_grad:
            torch.autograd.grad(loss, leaves, allow_unused=True)
        backward_peak_bytes = tracker.peak_bytes - after_forward_bytes
    return LossProfile(
        forward_workspace_bytes=max(0, forward_peak_bytes - saved_bytes),
        saved_bytes=saved_bytes,
        backward_workspace_bytes=max(0, backward_peak_bytes),
        held_bytes=2 * loss.untyped_storage().nbytes(),
    )


def _output_like(model: torch.nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The model's output structure with zero tensors of its shapes that require grad (floating ones).

    The model runs under a FakeTensorMode (no memory, no compute; its buffers and RNG are restored);
    a model that fake tensors cannot run is run for real, without gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.graph_build import preserved_state

    with preserved_state(model):
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                output = model(*inputs, **kwargs)
        except Exception as error:  # data-dependent control flow, custom kernels
            log.info("fake forward failed (%s); running the model to learn its output", error)
            with torch.no_grad():
                output = model(*inputs, **kwargs)

    def zeros(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        tensor = torch.zeros(value.shape, dtype=value.dtype, device=value.device)
        return tensor.requires_grad_() if tensor.is_floating_point() else tensor

    return tree_map(zeros, output)


def optimize_compiled(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    budget_bytes: int,
    optimizer: OptimizerSpec,
    step: TrainingStep,
    loss_fn: Callable[[Any], torch.Tensor],
    solver: str,
    device: str | DeviceSpec | None,
) -> Plan:
    """Plan and compile the training step of `model` (see the module docstring); `plan.module` is the
    compiled model, sharing `model`'s parameters.

    NOTE [checked budget]: the compiled forward and backward are then measured once on the example
    inputs (the optimizer step runs eagerly and is predicted as for eager plans). Where the measured
    peak exceeds the budget, the model of inductor's memory missed something: the plan is made and
    compiled again under a lower budget (`lowered_budget_bytes`), at most `MAX_ATTEMPTS` times in all.
    A budget that even the lowest plan measures above raises `InfeasibleBudget` with that measurement.
    """
    started = time.perf_counter()
    call, request = _prepare(model, inputs, kwargs, budget_bytes, optimizer, step, loss_fn, solver, device)
    planning_s = 0.0
    for attempt in range(1, MAX_ATTEMPTS + 1):
        plan, module, spent_s = _plan_and_compile(call, request)
        planning_s += spent_s
        measured_bytes = _checked_peak_bytes(plan, module, call)
        if measured_bytes is None or measured_bytes <= budget_bytes or attempt == MAX_ATTEMPTS:
            break
        lowered_bytes = lowered_budget_bytes(
            budget_bytes=budget_bytes,
            predicted_bytes=plan.predicted_peak_bytes,
            measured_bytes=measured_bytes,
            min_peak_bytes=plan.min_peak_bytes,
        )
        if lowered_bytes >= request.budget_bytes:
            raise InfeasibleBudget(
                budget_bytes=budget_bytes, min_peak_bytes=measured_bytes, breakdown=plan.simulation.breakdown
            )
        log.warning(
            "compiled plan measured %s over its budget of %s (predicted %s); planning again under %s",
            format_bytes(measured_bytes - budget_bytes),
            format_bytes(budget_bytes),
            format_bytes(plan.predicted_peak_bytes),
            format_bytes(lowered_bytes),
        )
        request = dataclasses.replace(request, budget_bytes=lowered_bytes)
    plan.module = module
    plan.budget_bytes = budget_bytes
    plan.compiled = CompiledStep(
        compile_s=time.perf_counter() - started,
        planning_s=planning_s,
        measured_peak_bytes=measured_bytes,
        planned_budget_bytes=request.budget_bytes,
        attempts=attempt,
    )
    log.info("planned and compiled in %.1f s (%.1f s planning)", plan.compiled.compile_s, planning_s)
    return plan


def lowered_budget_bytes(
    *, budget_bytes: int, predicted_bytes: int, measured_bytes: int, min_peak_bytes: int
) -> int:
    """The budget to plan under after a compiled plan predicted at `predicted_bytes` measured
    `measured_bytes`, over `budget_bytes` (NOTE [checked budget]).

    The model missed `measured_bytes - predicted_bytes`; a plan predicted within the budget less that
    miss measures within the budget where the miss stays the same. (Lowering the planned budget by the
    excess alone lets the solver pick the same schedule again where it had bytes to spare: a BERT plan
    predicted at 4.15 MiB under 4.18 MiB measured 4.53 MiB, 5.4 KiB over its 4.52 MiB budget, twice.)
    Since a plan is predicted within its planned budget, this is never above the planned budget less the
    excess. Never below the lowest peak.
    """
    return max(min_peak_bytes, budget_bytes - (measured_bytes - predicted_bytes))


def plan_compiled_step(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    budget_bytes: int,
    optimizer: OptimizerSpec,
    step: TrainingStep,
    loss_fn: Callable[[Any], torch.Tensor],
    solver: str,
    device: str | DeviceSpec | None,
) -> Plan:
    """The plan `optimize_compiled` would install, without compiling anything: dynamo and AOT autograd
    trace the step, the partitioner plans it and stops the compile there. `plan.module` is None, and
    nothing is measured; the lowest and no-checkpointing peaks cost seconds, not a compile."""
    call, request = _prepare(model, inputs, kwargs, budget_bytes, optimizer, step, loss_fn, solver, device)
    _refuse_graph_breaks(call)
    planning = CompiledPlanning(request, plan_only=True)
    module = cast(torch.nn.Module, torch.compile(call.model, backend=_backend(planning), dynamic=False))
    with _dynamo_settings():
        _compile_step(module, call)
    return planning.plans[0]


def _refuse_graph_breaks(call: _ExampleStep) -> None:
    """`UnsupportedModel` naming the breaks where dynamo splits the model into several graphs (its
    trace, without compiling: `torch._dynamo.explain`); planning stops at the first graph, so the
    others would go unplanned."""
    from planner.graph_build import preserved_state

    with preserved_state(call.model), _dynamo_settings():
        explanation = torch._dynamo.explain(call.model)(*call.inputs, **call.kwargs)
    trained = [graph for graph in explanation.graphs if _needs_backward(graph)]
    if len(trained) > 1:
        reasons = "; ".join(
            sorted({str(reason.reason).splitlines()[0] for reason in explanation.break_reasons})
        )
        raise UnsupportedModel(
            f"torch.compile splits the model's training step into {len(trained)} graphs ({reasons}); "
            "planning the compiled step needs it in one graph: plan the eager model (compile=False) and "
            "compile plan.module, or remove the breaks"
        )


def _needs_backward(graph: torch.fx.GraphModule) -> bool:
    """Whether a graph dynamo captured takes a tensor that requires grad (AOT autograd then partitions
    it; graphs that do not, such as mask preparation before a logging call, are compiled for inference)."""
    return any(
        node.op == "placeholder" and getattr(node.meta.get("example_value"), "requires_grad", False)
        for node in graph.graph.nodes
    )


def _prepare(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    budget_bytes: int,
    optimizer: OptimizerSpec,
    step: TrainingStep,
    loss_fn: Callable[[Any], torch.Tensor],
    solver: str,
    device: str | DeviceSpec | None,
) -> tuple[_ExampleStep, _Request]:
    """The example step and the planning request: static memory probed, the loss measured."""
    targets: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    targets += [t for t in tensors_in((inputs, kwargs)) if t.requires_grad]
    if not targets:
        raise ValueError(
            "nothing to train: no parameter of the model and no input requires grad; "
            "checkpointing only matters for training steps"
        )
    request = _Request(
        budget_bytes=budget_bytes,
        solver=solver,
        static=static_bytes(model, (inputs, kwargs), gradient_bytes=0, optimizer=optimizer, step=step),
        loss=profile_loss(model, inputs, kwargs, loss_fn),
        spec=device_spec(device or _analytic_device(targets[0])),
        optimizer=optimizer_name(optimizer),
        step=step,
    )
    return _ExampleStep(model, inputs, kwargs, loss_fn, targets), request


MAX_ATTEMPTS = 3
"""Compilations `optimize_compiled` makes at most (NOTE [checked budget])."""
DYNAMO_LIMITS = {"recompile_limit": 2**10, "accumulated_recompile_limit": 2**16}
"""Each planning compiles the model afresh (a backend of its own), which dynamo counts as a recompile
of the model's code; planning the same model class many times must not hit its limits and fall back
to eager, which would leave the plan uninstalled."""
LOG_METHODS = ("debug", "info", "warning", "warning_once", "error")
"""`logging.Logger` methods dynamo skips while `optimize` compiles (NOTE [graph breaks]); transformers
adds `warning_once` to the class when it is imported."""


def log_methods() -> set[Callable[..., Any]]:
    """The `LOG_METHODS` that `logging.Logger` has now, for `ignore_logger_methods`."""
    return {method for name in LOG_METHODS if (method := getattr(logging.Logger, name, None)) is not None}


@contextlib.contextmanager
def _dynamo_settings() -> Iterator[None]:
    """DYNAMO_LIMITS, and log calls skipped rather than splitting the graph (NOTE [graph breaks])."""
    ignored = set(torch._dynamo.config.ignore_logger_methods) | log_methods()
    with torch._dynamo.config.patch({**DYNAMO_LIMITS, "ignore_logger_methods": ignored}):
        yield


@dataclass(frozen=True)
class _ExampleStep:
    """The example call and what its backward differentiates."""

    model: torch.nn.Module
    inputs: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]
    targets: list[torch.Tensor]

    def run(self, module: torch.nn.Module, on_phase: Callable[[str], None] = lambda phase: None) -> None:
        """One forward and backward through `module`; gradients go to `torch.autograd.grad`."""
        loss = self.loss_fn(module(*self.inputs, **self.kwargs))
        end_autocast_forward()
        on_phase("forward")
        torch.autograd.grad(loss, self.targets, allow_unused=True)
        del loss
        on_phase("backward")


def _plan_and_compile(call: _ExampleStep, request: _Request) -> tuple[Plan, torch.nn.Module, float]:
    """Compile `call.model` with a planning partitioner; its plan, the compiled module, seconds planning."""
    planning = CompiledPlanning(request)
    module = cast(torch.nn.Module, torch.compile(call.model, backend=_backend(planning), dynamic=False))
    with _dynamo_settings():
        _compile_step(module, call)
    if len(planning.plans) != 1:  # NOTE [graph breaks]
        raise UnsupportedModel(
            f"torch.compile split the training step into {len(planning.plans)} graphs (graph breaks: "
            "data-dependent control flow or calls dynamo cannot trace; torch._dynamo.explain(model)(*inputs) "
            "lists them); planning the compiled step needs the whole step in one graph: plan the eager model "
            "(compile=False) and compile plan.module, or remove the breaks"
        )
    return planning.plans[0], module, planning.planning_s


def _checked_peak_bytes(plan: Plan, module: torch.nn.Module, call: _ExampleStep) -> int | None:
    """NOTE [checked budget]: the measured forward/backward peak with the step's resident state, or the
    predicted peak after backward where higher; None on a device this cannot measure."""
    from planner.graph_build import preserved_state

    static = plan.graph.static
    device = call.targets[0].device
    with preserved_state(call.model):
        if device.type == "cpu":
            resident_bytes = storage_bytes([*call.model.parameters(), *call.model.buffers()])
            resident_bytes += storage_bytes(tensors_in((call.inputs, call.kwargs)))
            resident_bytes += static.optimizer_state_bytes + static.resident_gradient_bytes
            with AllocatorPhases(resident_bytes) as allocator:
                call.run(module, allocator.on_phase)
            measured_bytes = max(allocator.peaks.values())
        elif device.type == "cuda":
            torch.cuda.synchronize(device)
            before_bytes = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            call.run(module)
            torch.cuda.synchronize(device)
            measured_bytes = torch.cuda.max_memory_allocated(device) - before_bytes + static.resident_bytes
        else:
            return None
    after_backward = [step.live_bytes for step in plan.simulation.trace if step.phase.after_backward]
    return max([measured_bytes, *after_backward])


def _analytic_device(tensor: torch.Tensor) -> str:
    """The roofline that prices the compiled step's operators: only the ratios of times matter."""
    return "cpu" if tensor.device.type == "cpu" else "h100"


def _compile_step(module: torch.nn.Module, call: _ExampleStep) -> None:
    """One forward and backward through `module`, which compiles both graphs; RNG state and buffers
    are restored and no `.grad` is written, so the model is left as it was. A planner error raised
    inside the compiler (an infeasible budget) is raised as itself."""
    from planner.graph_build import preserved_state

    try:
        with preserved_state(call.model):
            call.run(module)
    except Exception as error:
        if _caused_by(error, _PlanOnly):
            return
        cause = _planner_cause(error)
        if cause is not None:
            raise cause from None
        raise


def _planner_cause(error: BaseException) -> PlannerError | None:
    """The planner error at the root of an exception the compiler wrapped, if there is one."""
    cause = _caused_by(error, PlannerError)
    return cause if isinstance(cause, PlannerError) else None


def _caused_by(error: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The exception of `kind` in the chain of `error` (the compiler wraps what a backend raises)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None
