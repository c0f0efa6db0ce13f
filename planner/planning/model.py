"""`profile`: a model's training step captured and measured once, then planned at any budget.

Why it exists: every way to plan a model (`optimize`, `pareto`, `Plan.replan`, the CLI, the service
client) needs the same three things: the captured model (capture/chain.py, or the module level when no
graph can be captured), the activation graph of one profiled training step (profiler/interpreter.py or
capture/model_call.py, then sharded and extended to the step the user runs), and a way to rewrite the model
for any schedule of that graph (rewrite/emit.py). A `Profile` holds them, so each path is "profile, then
solve, then rewrite", and none keeps a copy of the capture chain that could drift from the others
(the service client once did, and lost the export fallback). Solving a profile again costs no
profiling run, so plans compared on one profile rest on the same measured node times.

    profile = planner.profile(model, example_inputs, optimizer="adam")
    plan = profile.plan(budget_gb=8)                      # or profile.pareto(points=8)
    plan = profile.apply(client.plan_graph(profile.graph, budget_bytes=...))   # solved elsewhere

A profile also predicts a plan's peak at other input shapes (`predicted_peak_bytes`): the model's
graph is built again at those shapes on the meta device, as the profiled one was built on real
tensors (graphs built on meta equal real ones byte for byte), and the plan's regions are carried over
to it (NOTE [carried regions] in rewrite/other_shapes.py). Nothing of the model's size is allocated and
nothing runs for real, so a model whose forward reads tensor values (data-dependent routing, a root that
branches on a value) cannot be predicted this way and says so.

NOTE [larger shapes]: a budget is made for the example call. Smaller calls (a short last batch,
shorter sequences) fit it: every tensor is at most as large, the plan's regions are the same, and the
static memory does not change (a test measures half the batch and half the sequence on every zoo
family). A larger call may not fit, so a planned module warns once, at its first training call with a
tensor longer in some dimension than the example's, with the predicted peak at that call's shapes.
Plan with your largest batch and longest sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map

from planner.capture.chain import candidate_units, capture
from planner.capture.model_call import capture_model_call
from planner.capture.records import Capture, call_shapes
from planner.errors import LargerShapeWarning, UnsupportedModel, format_bytes
from planner.ir import (
    GLUE_OP,
    ActivationGraph,
    BudgetKind,
    CostModel,
    MemoryCounting,
    Schedule,
    Sharding,
    TrainingStep,
)
from planner.planning.arguments import (
    budget_bytes_of,
    cost_model_of,
    example_call,
    memory_counting_of,
    refuse_sharded_model,
    reshard_after_forward_of,
    sharding_of,
    training_step_of,
)
from planner.planning.fsdp_units import fsdp_units
from planner.planning.graph import Frontier, pareto_frontier, plan_graph
from planner.planning.plan import Plan
from planner.planning.tensor_parallel import (
    agreed_plan,
    check_tensor_parallel,
    collective_buffer_bytes,
)
from planner.profiler.cost_model import DeviceSpec, device_spec
from planner.profiler.interpreter import LOSS_NODE, build_activation_graph, preserved_state
from planner.profiler.measurement import OptimizerSpec, default_loss
from planner.profiler.sharding import shard_graph
from planner.profiler.split_calls import called_at_random
from planner.rewrite.emit import (
    AUTOCAST_DEVICES,
    add_forward_pre_hook,
    guard_gradients,
    rewrite,
)
from planner.rewrite.other_shapes import (
    align_names,
    carry_schedule,
    constants_on_meta,
    is_larger,
    meta_copy,
    outside_modes,
)
from planner.rewrite.units import rewrite_units
from planner.simulation.allocator import AllocatorSettings
from planner.simulation.micro_batches import for_training_step
from planner.simulation.step import simulate

__all__ = [
    "FSDP_CAPTURE_NOTE",
    "FSDP_UNITS_REASON",
    "Profile",
    "ProfileSettings",
    "profile",
]

log = logging.getLogger(__name__)

FSDP_UNITS_REASON = "sharding='fsdp' plans by submodules, so that fully_shard's units run as module calls"
"""Why FSDP plans skip FX and torch.export (see NOTE [FSDP2] in rewrite/emit.py)."""
FSDP_CAPTURE_NOTE = "fsdp units"
"""Appended to `Plan.capture` of a plan made for FSDP: "module (fsdp units)"."""


@dataclass(frozen=True)
class ProfileSettings:
    """The arguments of `profile` that shaped the graph, besides the model and its example call."""

    optimizer: OptimizerSpec
    step: TrainingStep
    loss_fn: Callable[[Any], torch.Tensor]
    cost_model: CostModel
    device: str | DeviceSpec | None
    world_size: int
    sharding: Sharding
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    """The autocast blocks (device type, dtype) the profile was made in: its graph's precision."""
    memory_counting: MemoryCounting = MemoryCounting.BLOCKS
    """How the graph counts each storage's bytes (NOTE [counted bytes] in ir.py)."""
    reshard_after_forward: bool = True
    """Under sharding='fsdp': whether `fully_shard` frees a block's parameters after its forward."""
    tensor_parallel: DeviceMesh | None = None
    """The tensor parallel DeviceMesh the model was parallelized over, or None: rank 0 of it solves and
    every rank takes its plan (NOTE [tensor parallel plans] in planning/tensor_parallel.py)."""


def _autocast_now() -> tuple[tuple[str, torch.dtype], ...]:
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def _autocast(blocks: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Exactly the given autocast blocks, whatever the caller's."""
    with contextlib.ExitStack() as stack:
        current = _autocast_now()
        if current != blocks:
            for device, _ in current:
                stack.enter_context(torch.autocast(device, enabled=False))
            for device, dtype in blocks:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


@dataclass(frozen=True, eq=False)
class Profile:
    """One profiled training step of `model`: everything a plan at any budget needs.

    `graph` is what the solvers take (sharded and extended to `settings.step`); `capture` is the
    captured graph the rewriter fuses regions in, or None for a model planned by its submodules
    (`graph.capture` starts with "module"). The model is shared, not copied: a plan's module shares its
    parameters, and changing the model's structure after profiling invalidates the profile.
    """

    model: torch.nn.Module
    example_args: tuple[Any, ...]
    example_kwargs: Mapping[str, Any]
    capture: Capture | None
    profiled_graph: ActivationGraph
    """The graph of one micro-batch as profiled, before sharding and the training step."""
    graph: ActivationGraph
    settings: ProfileSettings

    def plan(
        self,
        *,
        budget_gb: float | None = None,
        budget_bytes: int | None = None,
        solver: str = "auto",
        budget_kind: BudgetKind | str | None = None,
        allocator: AllocatorSettings | None = None,
    ) -> Plan:
        """The plan with the least predicted recompute whose predicted peak fits the budget, with its
        module. Raises `InfeasibleBudget` (with the lowest achievable peak) when none fits. The budget
        bounds `budget_kind` memory (NOTE [budget kinds] in ir.py), by default `default_budget_kind`;
        reserved memory is predicted for CUDA's caching allocator under `allocator` (default settings)."""
        budget = budget_bytes_of(budget_gb, budget_bytes)
        kind = self.default_budget_kind if budget_kind is None else budget_kind
        solve = functools.partial(
            plan_graph, budget_bytes=budget, solver=solver, budget_kind=kind, allocator=allocator
        )
        mesh = self.settings.tensor_parallel
        if mesh is None:
            return self.apply(solve(self.graph))
        # Solved on every rank's graph merged: the plan's graph is not this rank's own (NOTE [tensor
        # parallel plans] in planning/tensor_parallel.py); its schedule names the same nodes.
        planned = agreed_plan(self.graph, solve, mesh, buffer_bytes=self.collective_buffer_bytes)
        planned.module = self.rewrite(planned.schedule, budget_bytes=planned.budget_bytes)
        planned.profile = self
        return planned

    def without_examples(self) -> Profile:
        """This profile with its example call on the meta device, for what a planned module keeps: the
        module then holds none of the example's tensors alive while it trains on other batches (the
        prediction at another shape needs the example's shapes, not its values)."""
        capture = self.capture
        if capture is not None:
            capture = dataclasses.replace(capture, inputs=_on_meta(capture.inputs))
        return dataclasses.replace(
            self,
            example_args=_on_meta(self.example_args),
            example_kwargs=_on_meta(dict(self.example_kwargs)),
            capture=capture,
        )

    @functools.cached_property
    def collective_buffer_bytes(self) -> int:
        """Under tensor parallelism, the largest collective result of one step (probed once, by every
        rank together): the workspace a plan keeps for it (NOTE [tensor parallel plans])."""
        settings = self.settings
        return collective_buffer_bytes(self.model, self.example_args, self.example_kwargs, settings.loss_fn)

    @property
    def default_budget_kind(self) -> BudgetKind:
        """What a budget bounds unless told: allocated memory in 512-byte blocks, on every device. It is
        the figure measured on a GPU within 0.73 % of its prediction (NOTE [budget kinds] in ir.py); the
        reserved memory is predicted but not yet measured to match, so it is asked for by name."""
        return BudgetKind.ALLOCATED

    def pareto(
        self, *, points: int = 8, budgets_bytes: Sequence[int] | None = None, solver: str = "auto"
    ) -> Frontier:
        """Predicted (peak, recompute) at `budgets_bytes`, or at `points` budgets from the lowest
        achievable peak to the peak without checkpointing. `frontier.plot(path)` draws it."""
        return pareto_frontier(self.graph, budgets_bytes=budgets_bytes, points=points, solver=solver)

    def apply(self, plan: Plan) -> Plan:
        """Give `plan` (solved for `self.graph`, here or by a service) the rewritten module; returns it."""
        if plan.graph is not self.graph and plan.graph != self.graph:
            raise ValueError(
                "this plan was solved for another graph than this profile's; solve profile.graph "
                "(profile.plan(...), or PlannerClient.plan_graph(profile.graph, ...)) and apply that plan"
            )
        plan.module = self.rewrite(plan.schedule, budget_bytes=plan.budget_bytes)
        plan.profile = self
        return plan

    def rewrite(self, schedule: Schedule, *, budget_bytes: int | None = None) -> torch.nn.Module:
        """The model, checkpointed as `schedule` (a schedule of `self.graph`) says. It warns once when
        it trains on inputs larger than the example's (`LargerShapeWarning`, with the predicted peak
        at them, against `budget_bytes`)."""
        if self.capture is None:
            module = rewrite_units(self.model, self.graph, schedule)
        else:
            module = rewrite(self.model, self.capture, self.graph, schedule)
        module = guard_gradients(module, self.settings.step)
        warning = _LargerCallWarning(self.without_examples(), schedule, budget_bytes)
        add_forward_pre_hook(module, warning, with_kwargs=True)
        return module

    def predicted_peak_bytes(
        self, schedule: Schedule, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> int:
        """Predicted peak of the training step under `schedule` (a schedule of `self.graph`) when each
        micro-batch is `model(*args, **kwargs)`, from the graph built at those shapes on the meta
        device (see the module docstring). Raises `UnsupportedModel` when it cannot be built there."""
        graph, matched = self._graph_at(tuple(args), dict(kwargs))
        return simulate(graph, carry_schedule(schedule, self.graph, graph, matched)).peak_bytes

    def _graph_at(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[ActivationGraph, dict[str, str]]:
        """The solve-ready graph at the call's shapes, and its node names by the profiled graph's."""
        settings = self.settings
        try:
            with outside_modes(), _autocast(settings.autocast):
                meta_model = meta_copy(self.model)
                meta_args, meta_kwargs = _on_meta((args, kwargs))
                if self.capture is None:
                    captured = capture_model_call(
                        meta_model,
                        meta_args,
                        meta_kwargs,
                        nested_units=settings.sharding is not Sharding.FSDP,
                    )
                else:
                    captured = capture(meta_model, meta_args, meta_kwargs)
                    constants_on_meta(captured.graph_module)
                graph = build_activation_graph(
                    captured,
                    meta_model,
                    captured.inputs,
                    loss_fn=settings.loss_fn,
                    optimizer=None,
                    step=settings.step,
                    cost_model=CostModel.ANALYTIC,
                    device=device_spec("cpu"),
                    memory_counting=settings.memory_counting,
                )
                if self.capture is None:
                    matched = {node.name: node.name for node in self.profiled_graph.nodes}
                else:
                    matched = align_names(self.capture.graph_module.graph, captured.graph_module.graph)
        except UnsupportedModel:
            raise
        except Exception as error:  # noqa: BLE001 - a forward that needs values cannot run on meta
            raise UnsupportedModel(
                f"cannot predict the peak of {type(self.model).__name__} at tensor shapes "
                f"{call_shapes(args, kwargs)} without running it: its forward does not run on the meta "
                f"device ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                "measure a copy instead: planner.measure(copy.deepcopy(plan.module), inputs)"
            ) from error
        # Parameters, buffers and the end of the step (the optimizer's) do not depend on the inputs'
        # shapes: they are the profile's.
        static = dataclasses.replace(
            self.profiled_graph.static,
            input_bytes=graph.static.input_bytes,
            gradient_bytes=graph.static.gradient_bytes,
        )
        graph = dataclasses.replace(graph, static=static, optimizer=self.profiled_graph.optimizer)
        matched = {old: new for old, new in matched.items() if old != LOSS_NODE} | {LOSS_NODE: LOSS_NODE}
        return _for_settings(graph, self.model, settings), matched


def _on_meta(values: Any) -> Any:
    """`values` with every tensor replaced by one on the meta device with its shape, strides and
    storage: a tensor passed twice (`input_ids` as `labels`) or a slice of a larger batch holds the
    memory it holds for real. An input that requires grad becomes a leaf of its own."""
    copies: dict[int, torch.Tensor] = {}
    storages: dict[int, torch.UntypedStorage] = {}

    def on_meta(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in copies:
            return copies[id(value)]
        if value.requires_grad:
            meta = torch.empty_like(value, device="meta").requires_grad_()
        else:
            storage = value.untyped_storage()
            if id(storage) not in storages:
                base = torch.empty(storage.nbytes(), dtype=torch.uint8, device="meta")
                storages[id(storage)] = base.untyped_storage()
            meta = torch.empty(0, dtype=value.dtype, device="meta")
            meta.set_(storages[id(storage)], value.storage_offset(), value.shape, value.stride())
        copies[id(value)] = meta
        return meta

    return tree_map(on_meta, values)


class _LargerCallWarning:
    """Forward pre-hook of a planned module: warns once, at the first training call with inputs larger
    than the example's, with the predicted peak at that call's shapes (NOTE [larger shapes])."""

    def __init__(self, profile: Profile, schedule: Schedule, budget_bytes: int | None) -> None:
        self.profile = profile
        self.schedule = schedule
        self.budget_bytes = budget_bytes
        self.example_shapes = call_shapes(profile.example_args, profile.example_kwargs)
        self.warned = False

    def __deepcopy__(self, memo: dict[int, Any]) -> _LargerCallWarning:
        """A copy of a planned module warns once too; the prediction only reads the profile."""
        return _LargerCallWarning(self.profile, self.schedule, self.budget_bytes)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.warned or not (module.training and torch.is_grad_enabled()):
            return
        shapes = call_shapes(args, kwargs)
        if not is_larger(self.example_shapes, shapes):
            return
        self.warned = True
        warnings.warn(self._message(args, kwargs, shapes), LargerShapeWarning, stacklevel=3)

    def _message(self, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Any) -> str:
        try:
            peak_bytes = self.profile.predicted_peak_bytes(self.schedule, args, kwargs)
        except UnsupportedModel as error:
            predicted = f"its peak there is not predicted: {error}"
        else:
            predicted = f"predicted peak {format_bytes(peak_bytes)} at them"
            if self.budget_bytes is not None:
                spare = self.budget_bytes - peak_bytes
                where = "within" if spare >= 0 else "over"
                budget = format_bytes(self.budget_bytes)
                predicted += f", {format_bytes(abs(spare))} {where} the budget of {budget}"
        return (
            f"plan.module was planned for an example call with tensor shapes {self.example_shapes}; this "
            f"training call is larger, {shapes}: {predicted}. The budget holds for the example and every "
            "smaller call: plan with your largest batch and longest sequence. (Warned once; "
            "plan.predicted_peak_bytes_for(*inputs, **kwargs) predicts any shape.)"
        )


def profile(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    optimizer: OptimizerSpec = "adam",
    step: TrainingStep | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    cost_model: CostModel | str = CostModel.MEASURED,
    device: str | DeviceSpec | None = None,
    world_size: int = 1,
    sharding: Sharding | str = Sharding.DDP,
    memory_counting: MemoryCounting | str = MemoryCounting.BLOCKS,
    reshard_after_forward: bool = True,
    tensor_parallel: DeviceMesh | None = None,
) -> Profile:
    """Capture `model` and profile one training step of it; plan with `.plan(budget_gb=...)`.

    The arguments are `planner.optimize`'s without the budget and the solver (see its docstring).
    Raises `UnsupportedModel` when no capture level works, and TypeError/ValueError naming a bad
    argument. The model is left unchanged. With `tensor_parallel=mesh` every rank of the mesh must
    call `.plan(...)` together: rank 0 solves, every rank gets its plan.
    """
    settings = ProfileSettings(
        optimizer=optimizer,
        step=training_step_of(step),
        loss_fn=loss_fn or default_loss,
        cost_model=cost_model_of(cost_model),
        device=device,
        world_size=world_size,
        sharding=sharding_of(world_size, sharding),
        autocast=_autocast_now(),
        memory_counting=memory_counting_of(memory_counting),
        reshard_after_forward=reshard_after_forward_of(
            sharding_of(world_size, sharding), reshard_after_forward
        ),
        tensor_parallel=tensor_parallel,
    )
    refuse_sharded_model(model)
    check_tensor_parallel(model, settings.tensor_parallel, settings.world_size)
    args = example_call(example_inputs, example_kwargs)
    kwargs = dict(example_kwargs or {})
    if settings.sharding is Sharding.FSDP and settings.cost_model is CostModel.MEASURED:
        return _profile_units(model, args, kwargs, settings, reason=FSDP_UNITS_REASON)
    started = time.perf_counter()
    try:
        captured = capture(model, args, kwargs)
    except UnsupportedModel as unsupported:
        if settings.cost_model is not CostModel.MEASURED:
            raise
        log.info("%s; planning by submodules", unsupported)
        return _profile_units(model, args, kwargs, settings, reason=str(unsupported))
    log.info("captured %d nodes by %s", len(captured.graph_module.graph.nodes), captured.path)
    profiled = build_activation_graph(
        captured,
        model,
        captured.inputs,
        loss_fn=settings.loss_fn,
        optimizer=optimizer,
        step=settings.step,
        cost_model=settings.cost_model,
        device=device,
        memory_counting=settings.memory_counting,
    )
    log.info("profiled %d nodes in %.1f s", len(profiled.nodes), time.perf_counter() - started)
    return _profile_of(model, args, kwargs, captured, profiled, settings)


def _profile_of(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    captured: Capture | None,
    profiled: ActivationGraph,
    settings: ProfileSettings,
) -> Profile:
    """The Profile of one profiled graph, with the graph the solvers take made from it."""
    return Profile(
        model=model,
        example_args=args,
        example_kwargs=kwargs,
        capture=captured,
        profiled_graph=profiled,
        graph=_for_settings(profiled, model, settings),
        settings=settings,
    )


def _for_settings(
    profiled: ActivationGraph, model: torch.nn.Module, settings: ProfileSettings
) -> ActivationGraph:
    """The profiled graph of one rank's micro-batch, sharded and extended to the training step."""
    sharded = shard_graph(
        profiled,
        world_size=settings.world_size,
        sharding=settings.sharding,
        units=fsdp_units(
            model,
            world_size=settings.world_size,
            counting=profiled.memory_counting,
            reshard_after_forward=settings.reshard_after_forward,
        )
        if settings.sharding is Sharding.FSDP
        else None,
    )
    return for_training_step(sharded, settings.step)


def _profile_units(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    settings: ProfileSettings,
    *,
    reason: str,
) -> Profile:
    """The module level of the capture chain (capture/model_call.py), used for `reason`."""
    captured = capture_model_call(model, args, kwargs, nested_units=settings.sharding is not Sharding.FSDP)
    profiled = build_activation_graph(
        captured,
        model,
        captured.inputs,
        loss_fn=settings.loss_fn,
        optimizer=settings.optimizer,
        step=settings.step,
        memory_counting=settings.memory_counting,
    )
    _check_units(model, args, kwargs, profiled, reason)
    if settings.sharding is Sharding.FSDP:
        profiled = dataclasses.replace(profiled, capture=f"{profiled.capture} ({FSDP_CAPTURE_NOTE})")
    return _profile_of(model, args, kwargs, None, profiled, settings)


def _check_units(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], graph: ActivationGraph, reason: str
) -> None:
    """Raise `UnsupportedModel` (after `reason`) when the module level found no unit to checkpoint, or
    units that the forward calls at random.

    NOTE [layers called at random]: a root forward that skips layers at random (LayerDrop, Hugging Face
    wav2vec2's default `layerdrop=0.1`) calls other units from one step to the next, which the module
    level's probe cannot tell from calls that follow the data (`static_split_calls`). The refusal then
    says which it is, and how to turn the skipping off, rather than blaming the data; before, wav2vec2's
    refusal said its submodules were called "depending on the data". Every plan by units is checked so
    (`called_at_random`'s forwards), not only one whose probe found no unit: the probe's three forwards
    drew the same layers often enough that wav2vec2 with LayerDrop was planned, and its plans measured
    up to 738,816 B below their prediction when a layer was skipped (`python -m bench.out_of_zoo`).
    """
    candidates = tuple(candidate_units(model))
    with preserved_state(model):
        random_calls = called_at_random(model, candidates, args, kwargs)
    if random_calls:
        raise UnsupportedModel(
            f"{reason}; and at the module level the forward of {type(model).__name__} calls other "
            f"submodules among {list(candidates)[:6]} from one run to the next on the same inputs "
            "(layers skipped at random: LayerDrop, or stochastic depth that skips), so no plan of one "
            "step holds for the next; turn the skipping off to plan it (Hugging Face: "
            "config.layerdrop = 0.0 before building the model)"
        )
    units = [node for node in graph.nodes if node.part_of and node.op != GLUE_OP]
    if not units:
        raise UnsupportedModel(
            f"{reason}; and at the module level the forward of {type(model).__name__} calls its submodules "
            f"{list(candidates)[:6]} depending on the data (other calls or shapes on other inputs), so "
            "checkpointing one would move bytes with the data"
        )
    if not any(node.checkpointable for node in units):
        raise UnsupportedModel(
            f"{reason}; and the module level found no submodule to checkpoint among "
            f"{[node.module_path for node in units][:6]} (one must be called once per step and carry no "
            "hooks)"
        )
