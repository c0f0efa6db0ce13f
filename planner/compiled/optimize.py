"""`optimize(..., compile=True)`: plan the step `torch.compile` runs, and install the plan in inductor.

An eager plan translated to a compiled model plans the wrong graph: inductor fuses operators, keeps
fewer intermediates and recomputes cheap ones on its own, so the compiled step's memory differs from
the eager step's in both directions. Here the planner plans the compiled step itself:

1. The model is compiled with inductor and a partitioner of ours (`custom_partitioner_fn`, inductor's
   public hook). When AOT autograd hands it the joint forward-backward graph, the partitioner builds
   the planner's ActivationGraph of it (joint_graph.py), adds the whole step's static memory
   (parameters, gradients, optimizer state: profiler/static_memory.py) and the loss, measured eagerly, and
   solves it with the planner's own solvers under the byte budget.
2. The schedule becomes the set of values the forward saves (a checkpointed region keeps its inputs,
   its backward recomputes the rest; random draws are always saved, so recomputed dropout replays its
   mask: NOTE [random operators] in groups.py). inductor's min-cut partitioner then builds the
   forward and backward graphs around that set, and the backward runs in the planned order.
3. One forward and backward on the example inputs compiles both graphs; the model's state is left as
   it was (gradients go to `torch.autograd.grad`, RNG state and buffers are restored).

A step dynamo splits has no one joint graph: split_step.py plans it (NOTE [graph breaks] there).

NOTE [partitioner hook]: torch 2.13 offers two hooks. `activation_memory_budget_solver` takes a
`CustomKnapsackSolver`, but it only chooses which of the min-cut's *banned* nodes may be recomputed,
at a budget given as a fraction, and the min-cut then decides the saved set: it cannot install a
saved set. `torch._inductor.config.custom_partitioner_fn` replaces the partitioner. Ours calls
`min_cut_rematerialization_partition` itself (so CSE, RNG functionalization, symbolic sizes and
mutations are handled as inductor handles them) with its one decision, `choose_saved_values_set`,
substituted for the duration of the call. That substitution and NOTE [kernel groups]'s are the only
uses of private names; a torch without this one raises `UnsupportedModel` saying so.

NOTE [buffer pool]: inductor's generated code keeps a dead buffer allocated until a later buffer of the
same size and dtype takes it over (`allow_buffer_reuse`), which saves an allocation but holds memory
between the two: in a backward that recomputes, the replayed blocks' buffers stay allocated while the
blocks after them run, and the peak rises above what the program's liveness needs. The planner turns
that pool off for its compile (buffers are freed when they die; a kernel still writes its output
into a dying input's buffer, `inplace_buffers`), so that memory is the liveness it predicts.

NOTE [backward order]: inductor reorders each graph for peak memory (`reorder_for_peak_memory`) with
heuristics on its own fused kernels, which the planner cannot predict before they exist. The planner
instead chooses the backward's order itself (the same least-peak-first heuristic on its model of the
kernels, or autograd's order when that is lower: `backward_order` in backward_order.py), imposes it
on the partitioned backward, and turns inductor's reordering off for this compile, so that the order
it predicts is the order that runs (fusion keeps it too: NOTE [order after fusion] in
backward_order.py).

NOTE [horizontal fusion]: inductor's scheduler also fuses kernels that read the same buffer without
depending on each other ("horizontal" fusion), and a fused kernel runs where its earliest part would
have. In a backward that recomputes, two checkpointed regions' recomputes read the same attention mask
or dropout seeds, so the later region's recompute was pulled forward to the earlier one's and both were
alive at once: GPT-2's plans measured 15 % above their prediction and were compiled again under lower
budgets. inductor's own guard against this (`are_long_distant_nodes`, which names activation
checkpointing as its case) only sees nodes more than 64 apart. Every compile of a planned module (a
recompile at another shape included) asks `_PlannedFusion`, which refuses a horizontal fusion in the
backward that would move a replay out of its step: one side computes a forward operator the backward
replays (`replayed`), and the two sides start in different nodes' backward steps (a kernel that
vertical fusion has already spread over several steps runs at its first). Every other fusion is
inductor's as before. Refusing every fusion whose sides touch more than one step, as this did
first, cost ResNet 2-3 % of its step time: of 75 fusions it refused in the plan at the largest budget
22 are refused now, and the plan at 9.79 MiB ran at 1.025x compiled no checkpointing, against 1.006x
now and 0.996x with no fusion refused (600 interleaved rounds, one-off). For it to
be asked, the backward is compiled with the forward (`force_non_lazy_backward_lowering`), not at its
first run.

NOTE [kernel groups]: inductor's C++ backend writes consecutive kernels into one C++ function until an
extern kernel (a matrix multiply, a convolution) or too many arguments flush it; every output of the
group is allocated before the call and every input that dies in it is freed after. So a recompute that
follows a step's last kernel ran inside that step: Llama's final norm, replayed for the head's weight
gradient, was computed in the function that computes the log-softmax backward, while the logits,
their gradient and autograd's zero gradient for them were all allocated, and plans measured 34 KiB
(0.8 %) above their prediction and were compiled again. While the planner compiles, the scheduler
flushes before a backward kernel that starts another of the plan's steps (`_step_flushing`, in place
of `Scheduler.enter_context`, a private name like the one NOTE [partitioner hook] substitutes), so the
storages a step frees are freed before the next step's kernels run, as the simulator has them.

NOTE [hoisted operators]: a backward operator that needs no gradient (a ReLU's `le` mask, a LayerNorm
backward's scale) is computed at the end of the partitioned forward and saved in place of its inputs:
the partitioner appends it to the forward graph after the forward's own operators. inductor then
fused the masks and scales of every layer into one kernel at the very end, so each layer's input to
its ReLU (1 MiB a layer in a four-layer ViT) stayed allocated through the whole forward, and the
compiled step measured 1.5 MiB (4 %) above a prediction that places each such operator with the
forward operator it differentiates (`place_hoisted` in groups.py). The planner's partition moves each
of them to just after its inputs are made (`order_forward`): that ViT's compiled peak without
checkpointing dropped from 35.89 to 34.32 MB (37.46 to 35.88 with `fallback_random`), each as
predicted to the byte (tests/planner/test_compiled_out_of_zoo.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx
from torch._functorch import partitioners
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._inductor.scheduler import Scheduler
from torch._inductor.virtualized import V
from torch.utils._pytree import tree_map

from planner.compiled.backward_order import after_fusion, order_backward
from planner.compiled.joint_graph import LossProfile, build_compiled_graph, retained_storages, saved_values
from planner.compiled.replay_copies import copy_replays_for_readers
from planner.compiled.split_step import SplitPlanning, eager_profile, optimize_split, splits
from planner.compiled.step import (
    MAX_ATTEMPTS,
    ExampleStep,
    PlanOnly,
    SplitStep,
    checked_peak_bytes,
    compile_step,
    dynamo_settings,
    graph_breaks,
    raise_if_over,
    replanned_budget_bytes,
    split_text,
)
from planner.errors import UnsupportedModel
from planner.ir import StaticBytes, TrainingStep
from planner.planning.graph import plan_graph
from planner.planning.plan import Plan
from planner.profiler.cost_model import DeviceSpec, device_spec
from planner.profiler.counting import LiveStorageTracker, tensors_in
from planner.profiler.measurement import OptimizerSpec, end_autocast_forward
from planner.profiler.static_memory import optimizer_name, static_bytes
from planner.simulation.micro_batches import for_training_step
from planner.solvers.solved_plan import CompiledStep

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
    graphs: int = 0
    """Graphs dynamo has handed the backend while `optimize` compiles the example step: a second one
    means the step is split (NOTE [graph breaks]). A recompile later (another shape, another grad
    mode) is planned on its own."""
    compiling_example: bool = False
    breaks_before: Counter[str] = field(default_factory=Counter)
    """Graph breaks dynamo had counted in this process when the example step started compiling: the
    step's own are those counted since (a split's reasons name no earlier model's break)."""
    backward_steps: dict[str, int] = field(default_factory=dict)
    """Each operator of the planned backward graph -> the node whose backward step runs it (NOTE
    [horizontal fusion])."""
    replayed: frozenset[str] = frozenset()
    """The planned backward graph's operators that replay forward operators (NOTE [horizontal
    fusion])."""
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
                "the compiled step needs it (NOTE [partitioner hook] in planner/compiled/optimize.py); plan "
                "the eager model instead (compile=False) and compile plan.module"
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
            chosen.update(
                plan=plan, compiled=compiled, forward={node.name for node in node_info.required_fw_nodes}
            )
            values = saved_values(compiled, retained_storages(graph, plan.schedule))
            self.planning_s += time.perf_counter() - started
            if self.plan_only:
                self.plans.append(plan)
                raise PlanOnly
            return values

        with _substituted(partitioners, SUBSTITUTED, choose):
            forward, backward = partitioners.min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        self.plans.append(chosen["plan"])
        compiled = chosen["compiled"]
        ordered = order_backward(backward, compiled.kernel_order)
        replayed = {
            node.name
            for node in ordered.graph.nodes
            if node.op == "call_function" and node.name in chosen["forward"]
        }
        ordered, copies = copy_replays_for_readers(ordered, replayed)
        self.backward_steps = _node_steps(ordered, compiled.kernel_steps)
        self.replayed = frozenset(replayed | copies)
        return order_forward(forward, chosen["forward"]), ordered

    def uuid(self) -> Any:
        """Unique to this planning: no inductor cache may hand another budget's partition back."""
        return f"planner.compiled:{id(self)}"

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledPlanning:
        # inductor deep-copies its config (this object among it) to write repro scripts
        return self


def order_forward(forward: fx.GraphModule, required: set[str]) -> fx.GraphModule:
    """`forward` with each backward operator it computes ahead (not in `required`, the forward's own
    operators) placed right after the last of its inputs is made: NOTE [hoisted operators]."""
    nodes = list(forward.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    first = max((position[node] for node in forward.graph.find_nodes(op="placeholder")), default=0)
    following: dict[int, list[fx.Node]] = {}
    """Position of a node kept in place -> the operators moved to just after it, in graph order."""
    anchor: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "call_function" and node.name not in required:
            sources = (anchor.get(source, position[source]) for source in node.all_input_nodes)
            anchor[node] = max(sources, default=first)
            following.setdefault(anchor[node], []).append(node)
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node in anchor:
            continue
        for placed in (node, *following.get(position[node], ())):
            copied[placed] = graph.node_copy(placed, copied.__getitem__)
    return fx.GraphModule(forward, graph)


def _node_steps(backward: fx.GraphModule, kernel_steps: Mapping[str, int]) -> dict[str, int]:
    """Each node of the ordered backward -> the step of the first kernel at or after it, which is where
    `order_backward` put it (NOTE [horizontal fusion]); nodes after the last kernel, its step."""
    steps: dict[str, int] = {}
    pending: list[str] = []
    step = None
    for node in backward.graph.nodes:
        pending.append(node.name)
        if node.name in kernel_steps:
            step = kernel_steps[node.name]
            steps.update(dict.fromkeys(pending, step))
            pending = []
    if step is not None:
        steps.update(dict.fromkeys(pending, step))
    return steps


class _PlannedFusion(InductorChoices):
    """inductor's heuristics, less horizontal fusions of a replay with a kernel of another of the plan's
    backward steps (NOTE [horizontal fusion])."""

    def __init__(self, planning: CompiledPlanning) -> None:
        super().__init__()
        self.planning = planning

    def can_fuse_horizontal(  # type: ignore[override]  # an instance method: it reads the plan
        self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int
    ) -> bool:
        steps = self.planning.backward_steps
        if (
            V.graph.is_backward
            and steps
            and min(_steps_of(node1, steps), default=None) != min(_steps_of(node2, steps), default=None)
            and (_replays(node1, self.planning.replayed) or _replays(node2, self.planning.replayed))
        ):
            return False
        return InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)


def _step_flushing(planning: CompiledPlanning, enter_context: Callable[..., None]) -> Callable[..., None]:
    """`Scheduler.enter_context`, which the scheduler calls as it starts generating each node's code,
    preceded by a flush where a backward node starts another of the plan's steps (NOTE [kernel
    groups])."""
    last_steps: dict[int, set[int]] = {}

    def entering(scheduler: Any, node: Any) -> None:
        steps = planning.backward_steps
        if V.graph.is_backward and steps and not node.is_extern():
            node_steps = _steps_of(node, steps)
            if node_steps and last_steps.get(id(scheduler), node_steps) != node_steps:
                scheduler.flush()
            if node_steps:
                last_steps[id(scheduler)] = node_steps
        enter_context(scheduler, node)

    return entering


def _operator_names(node: Any) -> set[str]:
    """Names of the FX operators a scheduler node computes."""
    return {
        origin.name
        for part in node.get_nodes()
        if part.node is not None
        for origin in part.node.get_origins()
    }


def _steps_of(node: Any, steps: Mapping[str, int]) -> set[int]:
    """The backward steps of the FX operators a scheduler node computes (those the plan knows)."""
    return {steps[name] for name in _operator_names(node) if name in steps}


def _replays(node: Any, replayed: frozenset[str]) -> bool:
    """Whether a scheduler node computes a forward operator the backward replays."""
    return not replayed.isdisjoint(_operator_names(node))


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
        if planning.compiling_example:
            planning.graphs += 1
            if planning.graphs > 1:
                raise SplitStep(split_text(graph_breaks() - planning.breaks_before))
        # the backward compiled here too, not at its first run, so that _PlannedFusion is asked
        with (
            torch._functorch.config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True),
            V.set_choices_handler(_PlannedFusion(planning)),
            _substituted(Scheduler, "enter_context", _step_flushing(planning, Scheduler.enter_context)),
        ):
            return compile_fx(
                graph_module,
                example_inputs,
                config_patches={
                    **INDUCTOR_CONFIG,
                    "custom_partitioner_fn": planning,
                    "_post_fusion_custom_pass": after_fusion,
                },
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
        loss_bytes = tracker.counted(loss.untyped_storage().nbytes())
        saved_bytes = max(0, tracker.live_bytes - before_bytes - loss_bytes)
        tracker.reset_peak()
        after_forward_bytes = tracker.live_bytes
        if leaves and loss.requires_grad:
            torch.autograd.grad(loss, leaves, allow_unused=True)
        backward_peak_bytes = tracker.peak_bytes - after_forward_bytes
    return LossProfile(
        forward_workspace_bytes=max(0, forward_peak_bytes - saved_bytes),
        saved_bytes=saved_bytes,
        backward_workspace_bytes=max(0, backward_peak_bytes),
        held_bytes=2 * loss_bytes,
    )


def _output_like(model: torch.nn.Module, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The model's output structure with zero tensors of its shapes that require grad (floating ones).

    The model runs under a FakeTensorMode (no memory, no compute; its buffers and RNG are restored);
    a model that fake tensors cannot run is run for real, without gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.profiler.interpreter import preserved_state

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
    A budget that even the lowest plan measures above raises `InfeasibleBudget` with that measurement,
    and so does one the last attempt still measures above (with the lowest measurement: a plan whose
    compiled peak is over the budget is never returned).
    """
    started = time.perf_counter()
    call, request = _prepare(model, inputs, kwargs, budget_bytes, optimizer, step, loss_fn, solver, device)
    planning_s = 0.0
    reasons = ""
    measurements: list[int] = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            plan, module, spent_s = _plan_and_compile(call, request)
        except SplitStep as split:
            reasons = split.reasons
            break
        planning_s += spent_s
        measured_bytes = checked_peak_bytes(plan, module, call)
        if measured_bytes is not None:
            measurements.append(measured_bytes)
        if measured_bytes is None or measured_bytes <= budget_bytes or attempt == MAX_ATTEMPTS:
            break
        lowered_bytes = replanned_budget_bytes(plan, budget_bytes, request.budget_bytes, measured_bytes)
        request = dataclasses.replace(request, budget_bytes=lowered_bytes)
    if reasons:  # outside the handler, so that no later error chains to the split
        eager = SplitPlanning(request.budget_bytes, request.solver, optimizer, request.step)
        return optimize_split(call, eager, reasons, started)
    raise_if_over(plan, budget_bytes, measurements)
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
    nothing is measured; the lowest and no-checkpointing peaks cost seconds, not a compile. A step dynamo
    splits gets the eager plan `optimize` would start from (NOTE [graph breaks])."""
    call, request = _prepare(model, inputs, kwargs, budget_bytes, optimizer, step, loss_fn, solver, device)
    if splits(call):
        plan = eager_profile(call, optimizer, step).plan(budget_bytes=budget_bytes, solver=solver)
        plan.module = None
        return plan
    planning = CompiledPlanning(request, plan_only=True)
    module = cast(torch.nn.Module, torch.compile(call.model, backend=_backend(planning), dynamic=False))
    with dynamo_settings():
        compile_step(module, call)
    return planning.plans[0]


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
) -> tuple[ExampleStep, _Request]:
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
    return ExampleStep(model, inputs, kwargs, loss_fn, targets), request


def _plan_and_compile(call: ExampleStep, request: _Request) -> tuple[Plan, torch.nn.Module, float]:
    """Compile `call.model` with a planning partitioner; its plan, the compiled module, seconds planning."""
    planning = CompiledPlanning(request)
    module = cast(torch.nn.Module, torch.compile(call.model, backend=_backend(planning), dynamic=False))
    planning.breaks_before = graph_breaks()
    planning.compiling_example = True
    try:
        with dynamo_settings():
            compile_step(module, call)
    finally:
        planning.compiling_example = False
    breaks = graph_breaks() - planning.breaks_before
    if breaks:
        raise SplitStep(split_text(breaks))
    if not planning.plans:
        raise UnsupportedModel(
            "torch.compile made no graph of this step that needs a backward: nothing of the compiled step "
            "trains; plan the eager model (compile=False)"
        )
    return planning.plans[0], module, planning.planning_s


def _analytic_device(tensor: torch.Tensor) -> str:
    """The roofline that prices the compiled step's operators: only the ratios of times matter."""
    return "cpu" if tensor.device.type == "cpu" else "h100"
