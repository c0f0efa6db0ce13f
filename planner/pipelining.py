"""`optimize_pipeline`: one checkpoint plan per stage of a `torch.distributed.pipelining` schedule.

Why it exists: under a pipeline schedule each stage holds a different number of micro-batches in
flight (1F1B: stage s of S holds min(S - s, n) at once, GPipe all n), so one checkpointing policy for
every stage either wastes the last stages' memory or overflows the first. `optimize_pipeline` plans
every stage for the same per-device budget, each with the least recompute whose whole-schedule peak
fits (NOTE [stage memory] in simulation/pipeline.py says what a stage's rank holds), and reports the
stage whose time sets the schedule's step time.

    stages = [stage0, stage1]                              # torchtitan's manual split, one per stage
    pipeline = planner.optimize_pipeline(stages, (tokens_mb,), schedule="1f1b", micro_batches=8,
                                         budget_gb=40, loss_fn=loss_fn, example_target=targets_mb)
    stage = PipelineStage(pipeline.plans[rank].module, rank, len(stages), device)

NOTE [stage budgets]: the solvers minimise one micro-batch's recompute under a bound on one
micro-batch's peak; a stage's peak adds the micro-batches in flight, whose retained bytes the plan
also sets. So each stage is solved at single-micro-batch budgets found by bisection between the
lowest achievable peak and the peak without checkpointing, each solution predicted over the whole
schedule (`stage_peak`), and the fitting solution with the least recompute is kept. A stage whose
lowest plan does not fit raises `InfeasibleBudget` with its lowest predicted stage peak.

NOTE [one plan on every rank]: every rank must run the same plan for its stage, or the pipeline's
sends and receives disagree in shape or time. With the analytic cost model and the `dp` solver (the
default here) the answer is a function of the inputs alone: node bytes are counted, node times
priced from FLOPs, and dp has no clock. Measured node times differ between processes, and the ILP
solver stops at a wall-clock limit (`ILP_TIME_LIMIT_S` in solvers/__init__.py) when a loaded machine
reaches it before its deterministic-time limit, so either may give ranks different plans; with
`process_group=` rank 0 of the group plans and broadcasts the chosen schedules, and every rank
rewrites its own copy of the stages with them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from planner.errors import InfeasibleBudget, format_bytes
from planner.ir import CostModel, MemoryCounting, Schedule, TrainingStep
from planner.planning.arguments import budget_bytes_of, cost_model_of, memory_counting_of
from planner.planning.model import Profile, profile
from planner.planning.plan import Plan
from planner.profiler.cost_model import DeviceSpec
from planner.profiler.measurement import OptimizerSpec
from planner.serialize import schedule_from_dict, schedule_to_dict
from planner.simulation.micro_batches import for_training_step
from planner.simulation.pipeline import (
    PipelineSchedule,
    StagePeak,
    StageStatic,
    in_flight_at_peak,
    stage_actions,
    stage_peak,
)
from planner.simulation.step import simulate, store_everything
from planner.solvers import check_solver, lowest_peak, solve

__all__ = ["PipelinePlan", "StageReport", "optimize_pipeline"]

BISECTION_STEPS = 12
"""Single-micro-batch budgets tried per stage (NOTE [stage budgets]): the interval between the lowest
and the unconstrained peak shrinks 4096-fold, finer than one solver step on the models we measured."""


@dataclass(frozen=True)
class StageReport:
    """One stage's predicted memory and time under its plan (bytes in the plan's counting)."""

    stage: int
    in_flight: int
    """Micro-batches in flight at the stage's peak (forward done, backward not)."""
    most_in_flight: int
    """The most micro-batches in flight at any backward of the schedule on this stage."""
    parameter_state_bytes: int
    """Parameters, buffers and optimizer state."""
    buffer_bytes: int
    """The schedule's receive buffers (inputs and output gradients, one per micro-batch) and the
    stage's share of the batch."""
    retained_bytes: int
    """What each micro-batch in flight holds (saved activations and its output)."""
    predicted_peak_bytes: int
    peak_action: str
    compute_ms: float
    """Forward and backward of one micro-batch without recompute (the profile's node times)."""
    recompute_ms: float
    """Recompute of one micro-batch under the plan."""

    @property
    def micro_batch_ms(self) -> float:
        """One micro-batch's forward, backward and recompute on this stage."""
        return self.compute_ms + self.recompute_ms


@dataclass
class PipelinePlan:
    """One `Plan` per stage (hand `plans[s].module` to `PipelineStage`) and what each predicts."""

    plans: list[Plan]
    stages: list[StageReport]
    schedule: PipelineSchedule
    micro_batches: int
    budget_bytes: int

    @property
    def bottleneck_stage(self) -> int:
        """The stage with the longest micro-batch time, which every other stage waits for."""
        return max(range(len(self.stages)), key=lambda index: self.stages[index].micro_batch_ms)

    @property
    def predicted_step_ms(self) -> float:
        """The schedule's step time on this machine's node times: (n + S - 1) bottleneck micro-batches
        (GPipe and 1F1B run n micro-batches through S stages in n + S - 1 slots of the slowest stage)."""
        slots = self.micro_batches + len(self.stages) - 1
        return slots * self.stages[self.bottleneck_stage].micro_batch_ms

    def summary(self) -> str:
        """The per-stage report, as text (every figure predicted)."""
        lines = [
            f"{self.schedule.value} pipeline, {len(self.stages)} stages, {self.micro_batches} micro-batches, "
            f"budget {format_bytes(self.budget_bytes)} per device (all figures predicted)",
            "stage  in flight  params+optimizer  buffers     per micro-batch  peak        recompute/mb",
        ]
        for report in self.stages:
            lines.append(
                f"{report.stage:>5}  {report.in_flight:>9}  "
                f"{format_bytes(report.parameter_state_bytes):>16}  "
                f"{format_bytes(report.buffer_bytes):>10}  {format_bytes(report.retained_bytes):>15}  "
                f"{format_bytes(report.predicted_peak_bytes):>10}  {report.recompute_ms:>9.2f} ms"
            )
        lines.append(self.balance_note())
        return "\n".join(lines)

    def balance_note(self) -> str:
        """Which stage sets the step time and whether its recompute could be relieved."""
        slowest = self.stages[self.bottleneck_stage]
        note = (
            f"stage {slowest.stage} sets the step time: {slowest.micro_batch_ms:.2f} ms per micro-batch "
            f"({slowest.recompute_ms:.2f} ms of it recompute), predicted step {self.predicted_step_ms:.1f} ms"
        )
        if slowest.recompute_ms <= 0:
            return note + "; no stage recomputes on the critical path."
        spare = [
            report.stage
            for report in self.stages
            if report.micro_batch_ms + slowest.recompute_ms <= slowest.micro_batch_ms
            and report.stage != slowest.stage
        ]
        if spare:
            note += (
                f"; stages {spare} have time to spare: moving a block from stage {slowest.stage} to one of "
                "them (or a larger budget there) would shorten the step"
            )
        return note + "."

    def to_json(self) -> str:
        """The chosen schedules and reports, what rank 0 broadcasts (NOTE [one plan on every rank])."""
        return json.dumps(
            {
                "schedules": [schedule_to_dict(plan.schedule) for plan in self.plans],
                "stages": [dataclasses.asdict(report) for report in self.stages],
            },
            sort_keys=True,
        )


def _schedule_of(schedule: str | type | PipelineSchedule) -> PipelineSchedule:
    if isinstance(schedule, PipelineSchedule):
        return schedule
    names = {"ScheduleGPipe": PipelineSchedule.GPIPE, "Schedule1F1B": PipelineSchedule.ONE_F_ONE_B}
    if isinstance(schedule, type) and schedule.__name__ in names:
        return names[schedule.__name__]
    if isinstance(schedule, str) and schedule.lower() in {kind.value for kind in PipelineSchedule}:
        return PipelineSchedule(schedule.lower())
    raise ValueError(
        f"schedule={schedule!r}: optimize_pipeline plans 'gpipe' and '1f1b' (or ScheduleGPipe, "
        "Schedule1F1B); "
        "interleaved and zero-bubble schedules are not modelled yet"
    )


def stage_inputs(stages: Sequence[torch.nn.Module], example: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Each stage's example input: the previous stage's output on the example (run without grad), as
    the receiving stage gets it: a leaf that requires grad where it is floating point."""
    inputs = [tuple(example)]
    with torch.no_grad():
        for module in stages[:-1]:
            output = module(*inputs[-1])
            outputs = output if isinstance(output, tuple) else (output,)
            inputs.append(tuple(_received(value) for value in outputs))
    return inputs


def _received(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    return value


class _ReceivedGradient(torch.autograd.Function):
    """The 'loss' of a stage that is not the last: backward starts from a gradient the size of the
    stage's output that already exists (the schedule's receive buffer), as `stage_backward` does."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: _StageLoss) -> torch.Tensor:
        ctx.gradient = loss.gradient if loss.gradient is not None else torch.ones_like(output)
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.gradient, None


class _StageLoss:
    """A stage's `loss_fn(output)` for its profile: the schedule's loss on one micro-batch of targets
    (the last stage), else the received gradient's backward (`_ReceivedGradient`). `release` drops
    the example tensors once the stage is profiled, so the planned module, which keeps its profile,
    keeps no example alive on the stage's rank (measured: a micro-batch's input and the whole target
    batch a slice kept); later predictions at other shapes run on the meta device and make their own."""

    def __init__(
        self, loss_fn: Callable[[Any, Any], torch.Tensor] | None, target: Any, gradient: torch.Tensor | None
    ) -> None:
        self.loss_fn, self.target, self.gradient = loss_fn, target, gradient

    def __call__(self, output: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(output, self.target)
        return _ReceivedGradient.apply(output, self)

    def release(self) -> None:
        self.target, self.gradient = _on_meta(self.target), None


def _on_meta(value: Any) -> Any:
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


def _without_examples(profiled: Profile) -> Profile:
    """`profiled` with its example call on the meta device (see `_StageLoss`)."""
    example = tuple(_on_meta(value) for value in profiled.example_args)
    captured = profiled.capture
    if captured is not None:
        captured = dataclasses.replace(captured, inputs=tuple(_on_meta(value) for value in captured.inputs))
    return dataclasses.replace(profiled, example_args=example, capture=captured)


def _tensor_bytes(values: Any, counting: MemoryCounting) -> int:
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    return sum(counting.of(tensor.untyped_storage().nbytes()) for tensor in tensors)


def _stage_static(
    index: int, inputs: list[tuple[Any, ...]], outputs: list[tuple[Any, ...]], target: Any,
    micro_batches: int, counting: MemoryCounting,
) -> StageStatic:  # fmt: skip
    """What stage `index`'s rank holds besides its parameters (NOTE [stage memory])."""
    last = index == len(inputs) - 1

    def batch(values: Any) -> int:  # the whole batch is one tensor of n micro-batches
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        return sum(counting.of(micro_batches * v.untyped_storage().nbytes()) for v in tensors)

    batch_bytes = batch(inputs[0]) if index == 0 else 0
    if last and isinstance(target, torch.Tensor):
        batch_bytes += batch((target,))
    receive_bytes = 0
    if index > 0:
        receive_bytes += micro_batches * _tensor_bytes(inputs[index], counting)
    if not last:
        receive_bytes += micro_batches * _tensor_bytes(outputs[index], counting)
    return StageStatic(
        batch_bytes=batch_bytes,
        receive_bytes=receive_bytes,
        output_bytes=_tensor_bytes(outputs[index], counting),
        input_gradient_bytes=0 if index == 0 else _tensor_bytes(inputs[index], counting),
    )


def optimize_pipeline(
    stages: Sequence[torch.nn.Module],
    example_inputs: Any,
    *,
    schedule: str | type | PipelineSchedule = "1f1b",
    micro_batches: int,
    budget_gb: float | None = None,
    budget_bytes: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_target: Any = None,
    optimizer: OptimizerSpec = "adam",
    solver: str = "dp",
    cost_model: CostModel | str = CostModel.ANALYTIC,
    device: str | DeviceSpec | None = None,
    memory_counting: MemoryCounting | str = MemoryCounting.BLOCKS,
    process_group: Any = None,
) -> PipelinePlan:
    """Plan every stage of a pipeline for one per-device budget: `PipelinePlan.plans[s].module` is
    stage s checkpointed, to wrap in `torch.distributed.pipelining.PipelineStage`.

    `stages` are the stage modules in order, one per stage (as a manual split makes them);
    `example_inputs` one micro-batch of the first stage's inputs; each later stage's example is the
    previous stage's output. `loss_fn(output, target)` is the schedule's loss, `example_target` one
    micro-batch of targets. `schedule` is "gpipe" or "1f1b" (or the torch schedule class),
    `micro_batches` the schedule's `n_microbatches`. The budget counts, per device, the stage's
    parameters and optimizer state, its receive buffers, its share of the batch and every
    micro-batch in flight (NOTE [stage memory] in simulation/pipeline.py); run the schedule with
    `step(..., return_outputs=False)`, or the last stage also holds every micro-batch's output.

    Node times are analytic by default and the solver is `dp`, so that every rank computes the same
    plans (NOTE [one plan on every rank]); with `process_group`, rank 0 of the group plans and
    broadcasts. Raises `InfeasibleBudget` for the first stage no plan fits.
    """
    budget = budget_bytes_of(budget_gb, budget_bytes)
    kind = _schedule_of(schedule)
    check_solver(solver)
    counting = memory_counting_of(memory_counting)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(
            f"micro_batches={micro_batches!r}: must be an int >= 1 (the schedule's n_microbatches)"
        )
    if not stages:
        raise ValueError("stages is empty: pass the stage modules in order, one per pipeline stage")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    inputs = stage_inputs(stages, args)
    outputs = [*inputs[1:], _last_output(stages[-1], inputs[-1])]
    step = TrainingStep(accumulation_steps=micro_batches)
    device = _cost_device(stages, cost_model_of(cost_model), device)
    profiles = []
    for index, module in enumerate(stages):
        last = index == len(stages) - 1
        stage_loss = (
            _StageLoss(loss_fn, example_target, None)
            if last
            else _StageLoss(None, None, torch.ones_like(outputs[index][0]))
        )
        profiled = profile(
            module, inputs[index], optimizer=optimizer, step=step, loss_fn=stage_loss,
            cost_model=cost_model, device=device, memory_counting=counting,
        )  # fmt: skip
        stage_loss.release()
        profiles.append(_without_examples(profiled))
    statics = [
        _stage_static(index, inputs, outputs, example_target, micro_batches, counting)
        for index in range(len(stages))
    ]
    if process_group is None:
        return _solve_stages(profiles, statics, kind, micro_batches, budget, solver)
    return _broadcast_plans(profiles, statics, kind, micro_batches, budget, solver, process_group)


def _cost_device(
    stages: Sequence[torch.nn.Module], cost_model: CostModel, device: str | DeviceSpec | None
) -> str | DeviceSpec | None:
    """The analytic cost model's device: as given, else "cpu" for stages on the CPU."""
    if device is not None or cost_model is not CostModel.ANALYTIC:
        return device
    parameter = next((p for module in stages for p in module.parameters()), None)
    if parameter is None or parameter.device.type == "cpu":
        return "cpu"
    raise ValueError(
        f"the stages are on {parameter.device}: name the card to price their nodes on, device='h100' "
        "(the analytic cost model keeps every rank's plan the same, NOTE [one plan on every rank])"
    )


def _last_output(module: torch.nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    with torch.no_grad():
        output = module(*inputs)
    return output if isinstance(output, tuple) else (output,)


def _broadcast_plans(
    profiles: list[Profile], statics: list[StageStatic], kind: PipelineSchedule, micro_batches: int,
    budget: int, solver: str, group: Any,
) -> PipelinePlan:  # fmt: skip
    """Rank 0 of `group` solves; every rank applies its schedules (NOTE [one plan on every rank])."""
    import torch.distributed as dist

    message: list[str | None] = [None]
    if dist.get_rank(group) == 0:
        message[0] = _solve_stages(profiles, statics, kind, micro_batches, budget, solver).to_json()
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    assert message[0] is not None
    chosen = json.loads(message[0])
    plans = [
        _stage_plan(profiled, schedule_from_dict(data), budget)
        for profiled, data in zip(profiles, chosen["schedules"], strict=True)
    ]
    reports = [StageReport(**data) for data in chosen["stages"]]
    return PipelinePlan(
        plans=plans, stages=reports, schedule=kind, micro_batches=micro_batches, budget_bytes=budget
    )


def _stage_plan(profiled: Profile, schedule: Schedule, budget: int) -> Plan:
    plan = Plan(
        graph=profiled.graph,
        schedule=schedule,
        budget_bytes=budget,
        min_peak_bytes=lowest_peak(profiled.graph)[1].peak_bytes,
    )
    return profiled.apply(plan)


def _solve_stages(
    profiles: list[Profile], statics: list[StageStatic], kind: PipelineSchedule, micro_batches: int,
    budget: int, solver: str,
) -> PipelinePlan:  # fmt: skip
    plans, reports = [], []
    for index, (profiled, static) in enumerate(zip(profiles, statics, strict=True)):
        actions = stage_actions(kind, stage=index, stages=len(profiles), micro_batches=micro_batches)
        schedule, peak = _fitting_schedule(profiled, static, actions, budget, solver, index)
        plans.append(_stage_plan(profiled, schedule, budget))
        graph = profiled.graph
        reports.append(
            StageReport(
                stage=index,
                in_flight=peak.in_flight,
                most_in_flight=in_flight_at_peak(actions),
                parameter_state_bytes=graph.static.parameter_bytes
                + graph.static.buffer_bytes
                + graph.static.optimizer_state_bytes,
                buffer_bytes=static.batch_bytes + static.receive_bytes,
                retained_bytes=peak.retained_bytes,
                predicted_peak_bytes=peak.peak_bytes,
                peak_action=peak.peak_action,
                compute_ms=sum(node.forward_ms + node.backward_ms for node in graph.nodes),
                recompute_ms=peak.recompute_ms,
            )
        )
    return PipelinePlan(
        plans=plans, stages=reports, schedule=kind, micro_batches=micro_batches, budget_bytes=budget
    )


def predict_stage(
    profiled: Profile, static: StageStatic, actions: list[Any], schedule: Schedule
) -> StagePeak:
    """`schedule`'s predicted peak for a stage over the schedule's actions (NOTE [stage memory])."""
    first = for_training_step(profiled.profiled_graph, TrainingStep())
    return stage_peak(first, profiled.graph, schedule, static, actions)


def _fitting_schedule(
    profiled: Profile, static: StageStatic, actions: list[Any], budget: int, solver: str, index: int
) -> tuple[Schedule, StagePeak]:
    """The least-recompute schedule whose stage peak fits `budget` (NOTE [stage budgets])."""
    graph = profiled.graph
    unconstrained = store_everything(graph)
    peak = predict_stage(profiled, static, actions, unconstrained)
    if peak.peak_bytes <= budget:
        return unconstrained, peak
    lowest, lowest_result = lowest_peak(graph)
    lowest_stage = predict_stage(profiled, static, actions, lowest)
    if lowest_stage.peak_bytes > budget:
        raise InfeasibleBudget(
            budget_bytes=budget,
            min_peak_bytes=lowest_stage.peak_bytes,
            breakdown=lowest_result.breakdown,
            hint=f"pipeline stage {index}: its lowest plan holds {lowest_stage.in_flight} micro-batches in "
            f"flight at {lowest_stage.peak_action} ({format_bytes(lowest_stage.retained_bytes)} each); fewer "
            "micro-batches in flight (more stages, or GPipe -> 1F1B) or fewer blocks on this stage would "
            "help",
        )
    best = (lowest, lowest_stage)
    low, high = lowest_result.peak_bytes, simulate(graph, unconstrained).peak_bytes
    for _ in range(BISECTION_STEPS):
        middle = (low + high) // 2
        try:
            candidate = solve(graph, budget_bytes=middle, solver=solver)
        except InfeasibleBudget:
            low = middle
            continue
        predicted = predict_stage(profiled, static, actions, candidate)
        if predicted.peak_bytes <= budget:
            low = middle
            if (predicted.recompute_ms, predicted.peak_bytes) < (best[1].recompute_ms, best[1].peak_bytes):
                best = (candidate, predicted)
        else:
            high = middle
    return best
