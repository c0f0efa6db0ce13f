"""`optimize_pipeline`: every stage profiled, then each rank's stages solved for the budget together.

The call checks its arguments, profiles every stage (pipelining/stages.py makes what each is profiled
with), then solves each rank (NOTE [stage budgets] in planner/pipelining/__init__.py), here or on rank
0 of a process group (NOTE [one plan on every rank]).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from planner.errors import InfeasibleBudget, format_bytes
from planner.ir import Component, CostModel, MemoryCounting, Schedule, Sharding, TrainingStep
from planner.pipelining.report import PipelinePlan, StageReport
from planner.pipelining.stages import (
    StageLoss,
    cost_device,
    last_output,
    rank_actions,
    ranks_of,
    schedule_of,
    stage_inputs,
    stage_static,
)
from planner.planning.arguments import budget_bytes_of, cost_model_of, memory_counting_of
from planner.planning.model import Profile, profile
from planner.planning.plan import Plan
from planner.profiler.cost_model import DeviceSpec
from planner.profiler.measurement import OptimizerSpec
from planner.serialize import schedule_from_dict
from planner.simulation.micro_batches import for_training_step
from planner.simulation.pipeline import (
    Action,
    PipelineSchedule,
    RankPeak,
    StageModel,
    StageStatic,
    in_flight_at_peak,
    rank_peak,
)
from planner.simulation.step import simulate, store_everything
from planner.solvers import check_solver, lowest_peak, solve

__all__ = ["optimize_pipeline", "predict_rank"]

BISECTION_STEPS = 12
"""Single-micro-batch budgets tried per stage (NOTE [stage budgets]): the interval between the lowest
and the unconstrained peak shrinks 4096-fold, finer than one solver step on the models we measured."""


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
    ranks: int | None = None,
    world_size: int = 1,
    sharding: Sharding | str = Sharding.DDP,
    reshard_after_forward: bool = True,
) -> PipelinePlan:
    """Plan every stage of a pipeline for one per-device budget: `PipelinePlan.plans[s].module` is
    stage s checkpointed, to wrap in `torch.distributed.pipelining.PipelineStage`.

    `stages` are the stage modules in order, one per stage (as a manual split makes them);
    `example_inputs` one micro-batch of the first stage's inputs; each later stage's example is the
    previous stage's output. `loss_fn(output, target)` is the schedule's loss, `example_target` one
    micro-batch of targets. `schedule` is "gpipe", "1f1b" or "interleaved_1f1b" (or the torch
    schedule class), `micro_batches` the schedule's `n_microbatches`; an interleaved schedule also
    takes `ranks`, the pipeline's ranks (rank r holds stages r, r + ranks, ..., and its budget holds
    them all). The budget counts, per device, its stages' parameters and optimizer state, their
    receive buffers, their share of the batch and every micro-batch in flight (NOTE [stage memory]
    in simulation/pipeline.py); run the schedule with `step(..., return_outputs=False)`, or the last
    stage also holds every micro-batch's output.

    Each stage may itself be data parallel over `world_size` ranks: `sharding`, `reshard_after_forward`
    and the budget are then one rank's, as `planner.optimize` takes them (profiler/sharding.py).

    Node times are analytic by default and the solver is `dp`, so that every rank computes the same
    plans (NOTE [one plan on every rank]); with `process_group`, rank 0 of the group plans and
    broadcasts. Raises `InfeasibleBudget` for the first rank no plans fit.
    """
    budget = budget_bytes_of(budget_gb, budget_bytes)
    kind = schedule_of(schedule)
    check_solver(solver)
    counting = memory_counting_of(memory_counting)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(
            f"micro_batches={micro_batches!r}: must be an int >= 1 (the schedule's n_microbatches)"
        )
    if not stages:
        raise ValueError("stages is empty: pass the stage modules in order, one per pipeline stage")
    ranks_count = ranks_of(kind, len(stages), ranks)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    inputs = stage_inputs(stages, args)
    outputs = [*inputs[1:], last_output(stages[-1], inputs[-1])]
    step = TrainingStep(accumulation_steps=micro_batches)
    device = cost_device(stages, cost_model_of(cost_model), device)
    profiles = []
    for index, module in enumerate(stages):
        last = index == len(stages) - 1
        stage_loss = (
            StageLoss(loss_fn, example_target, None)
            if last
            else StageLoss(None, None, torch.ones_like(outputs[index][0]))
        )
        profiled = profile(
            module, inputs[index], optimizer=optimizer, step=step, loss_fn=stage_loss,
            cost_model=cost_model, device=device, memory_counting=counting, world_size=world_size,
            sharding=sharding, reshard_after_forward=reshard_after_forward,
        )  # fmt: skip
        stage_loss.release()
        profiles.append(profiled.without_examples())
    statics = [
        stage_static(index, inputs, outputs, example_target, micro_batches, counting)
        for index in range(len(stages))
    ]
    pipeline = _Pipeline(kind, ranks_count, micro_batches, budget, solver)
    if process_group is None:
        return _solve_stages(profiles, statics, pipeline)
    return _broadcast_plans(profiles, statics, pipeline, process_group)


def _broadcast_plans(
    profiles: list[Profile], statics: list[StageStatic], pipeline: _Pipeline, group: Any
) -> PipelinePlan:
    """Rank 0 of `group` solves; every rank applies its schedules (NOTE [one plan on every rank])."""
    import torch.distributed as dist

    message: list[str | None] = [None]
    if dist.get_rank(group) == 0:
        message[0] = _solve_stages(profiles, statics, pipeline).to_json()
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    assert message[0] is not None
    chosen = json.loads(message[0])
    plans = [
        _stage_plan(profiled, schedule_from_dict(data), pipeline.budget_bytes)
        for profiled, data in zip(profiles, chosen["schedules"], strict=True)
    ]
    return PipelinePlan(
        plans=plans,
        stages=[StageReport(**data) for data in chosen["stages"]],
        schedule=pipeline.kind,
        micro_batches=pipeline.micro_batches,
        budget_bytes=pipeline.budget_bytes,
    )


def _stage_plan(profiled: Profile, schedule: Schedule, budget: int) -> Plan:
    plan = Plan(
        graph=profiled.graph,
        schedule=schedule,
        budget_bytes=budget,
        min_peak_bytes=lowest_peak(profiled.graph)[1].peak_bytes,
    )
    return profiled.apply(plan)


@dataclass(frozen=True)
class _Pipeline:
    """What the solve needs besides the stages: the schedule's shape and the budget."""

    kind: PipelineSchedule
    ranks: int
    micro_batches: int
    budget_bytes: int
    solver: str


def _solve_stages(profiles: list[Profile], statics: list[StageStatic], pipeline: _Pipeline) -> PipelinePlan:
    """Each rank's stages planned together for its budget (NOTE [stage budgets])."""
    schedules: dict[int, Schedule] = {}
    reports: dict[int, StageReport] = {}
    for rank in range(pipeline.ranks):
        local = list(range(rank, len(profiles), pipeline.ranks))
        actions = rank_actions(
            pipeline.kind,
            rank=rank,
            ranks=pipeline.ranks,
            stages=len(profiles),
            micro_batches=pipeline.micro_batches,
        )
        chosen, peak = _fitting_schedules(
            [profiles[s] for s in local],
            [statics[s] for s in local],
            actions,
            pipeline,
            rank,
        )
        for position, stage in enumerate(local):
            schedules[stage] = chosen[position]
            graph = profiles[stage].graph
            reports[stage] = StageReport(
                stage=stage,
                rank=rank,
                in_flight=peak.in_flight[position],
                most_in_flight=in_flight_at_peak(actions, position),
                parameter_state_bytes=graph.static.parameter_bytes
                + graph.static.buffer_bytes
                + graph.static.optimizer_state_bytes,
                buffer_bytes=statics[stage].batch_bytes + statics[stage].receive_bytes,
                retained_bytes=peak.retained_bytes[position],
                predicted_peak_bytes=peak.peak_bytes,
                peak_action=peak.peak_action,
                compute_ms=sum(node.forward_ms + node.backward_ms for node in graph.nodes),
                recompute_ms=peak.recompute_ms[position],
            )
    plans = [
        _stage_plan(profiled, schedules[stage], pipeline.budget_bytes)
        for stage, profiled in enumerate(profiles)
    ]
    return PipelinePlan(
        plans=plans,
        stages=[reports[stage] for stage in range(len(profiles))],
        schedule=pipeline.kind,
        micro_batches=pipeline.micro_batches,
        budget_bytes=pipeline.budget_bytes,
    )


def predict_rank(
    profiles: list[Profile], statics: list[StageStatic], actions: list[Action], schedules: list[Schedule],
    sends_held: bool,
) -> RankPeak:  # fmt: skip
    """The predicted peak of a rank holding `profiles`' stages under `schedules` (NOTE [stage memory])."""
    models = [
        StageModel(
            first=for_training_step(profiled.profiled_graph, TrainingStep()),
            resident=profiled.graph,
            schedule=schedule,
            static=static,
        )
        for profiled, static, schedule in zip(profiles, statics, schedules, strict=True)
    ]
    return rank_peak(models, actions, sends_held=sends_held)


def _fitting_schedules(
    profiles: list[Profile],
    statics: list[StageStatic],
    actions: list[Action],
    pipeline: _Pipeline,
    rank: int,
) -> tuple[list[Schedule], RankPeak]:
    """The least-recompute schedules of a rank's stages whose rank peak fits the budget (NOTE [stage
    budgets]): each stage's single-micro-batch budget at the same fraction of the way from its lowest
    achievable peak to its peak without checkpointing, the fraction found by bisection."""
    budget, held = pipeline.budget_bytes, pipeline.kind.sends_held
    graphs = [profiled.graph for profiled in profiles]
    unconstrained = [store_everything(graph) for graph in graphs]
    peak = predict_rank(profiles, statics, actions, unconstrained, held)
    if peak.peak_bytes <= budget:
        return unconstrained, peak
    lowest = [lowest_peak(graph) for graph in graphs]
    lowest_schedules = [schedule for schedule, _ in lowest]
    lowest_rank = predict_rank(profiles, statics, actions, lowest_schedules, held)
    if lowest_rank.peak_bytes > budget:
        raise InfeasibleBudget(
            budget_bytes=budget,
            min_peak_bytes=lowest_rank.peak_bytes,
            breakdown=_rank_breakdown(graphs, statics, lowest_rank.peak_bytes),
            hint=f"pipeline rank {rank}: its lowest plans hold {list(lowest_rank.in_flight)} micro-batches "
            f"in flight at {lowest_rank.peak_action} "
            f"({', '.join(format_bytes(b) for b in lowest_rank.retained_bytes)} "
            "each); fewer micro-batches in flight (more ranks, or GPipe -> 1F1B) or fewer blocks on this "
            "rank would help",
        )
    ranges = [
        (result.peak_bytes, simulate(graph, schedule).peak_bytes)
        for graph, (_, result), schedule in zip(graphs, lowest, unconstrained, strict=True)
    ]
    best = (lowest_schedules, lowest_rank)
    low, high = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        try:
            candidates = [
                solve(
                    graph,
                    budget_bytes=int(bottom + middle * (top - bottom)),
                    solver=pipeline.solver,
                )
                for graph, (bottom, top) in zip(graphs, ranges, strict=True)
            ]
        except InfeasibleBudget:
            low = middle
            continue
        predicted = predict_rank(profiles, statics, actions, candidates, held)
        if predicted.peak_bytes > budget:
            high = middle
            continue
        low = middle
        if (sum(predicted.recompute_ms), predicted.peak_bytes) < (
            sum(best[1].recompute_ms),
            best[1].peak_bytes,
        ):
            best = (candidates, predicted)
    return best


def _rank_breakdown(graphs: list[Any], statics: list[StageStatic], peak_bytes: int) -> dict[Component, int]:
    """A rank's peak by component for `InfeasibleBudget`: its stages' state, the batch and buffers as
    inputs, the rest activations (micro-batches in flight, workspace, gradients)."""
    state = {
        Component.PARAMETERS: sum(graph.static.parameter_bytes for graph in graphs),
        Component.BUFFERS: sum(graph.static.buffer_bytes for graph in graphs),
        Component.OPTIMIZER_STATE: sum(graph.static.optimizer_state_bytes for graph in graphs),
        Component.INPUTS: sum(static.batch_bytes + static.receive_bytes for static in statics),
    }
    return {**state, Component.ACTIVATIONS: peak_bytes - sum(state.values())}
