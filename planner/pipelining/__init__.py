"""`optimize_pipeline`: one checkpoint plan per stage of a `torch.distributed.pipelining` schedule.

Why it exists: under a pipeline schedule each stage holds a different number of micro-batches in
flight (1F1B: stage s of S holds min(S - s, n) at once, GPipe all n), so one checkpointing policy for
every stage either wastes the last stages' memory or overflows the first. `optimize_pipeline` plans
every stage for the same per-device budget, each with the least recompute whose whole-schedule peak
fits (NOTE [stage memory] in simulation/pipeline.py says what a stage's rank holds), and reports the
rank whose time sets the schedule's step time.

`optimize` is the call and the solve, `stages` what each stage is profiled with (its example input,
its loss, what the schedule holds for it, the rank's order of actions) and `report` the result
(`PipelinePlan`, `StageReport`; no torch).

    stages = [stage0, stage1]                              # torchtitan's manual split, one per stage
    pipeline = planner.optimize_pipeline(stages, (tokens_mb,), schedule="1f1b", micro_batches=8,
                                         budget_gb=40, loss_fn=loss_fn, example_target=targets_mb)
    stage = PipelineStage(pipeline.plans[rank].module, rank, len(stages), device)

NOTE [stage budgets]: the solvers minimise one micro-batch's recompute under a bound on one
micro-batch's peak; a stage's peak adds the micro-batches in flight, whose retained bytes the plan
also sets. So each stage is solved at single-micro-batch budgets found by bisection between the
lowest achievable peak and the peak without checkpointing, each solution predicted over the whole
schedule (`rank_peak`), and the fitting solution with the least recompute is kept. A rank that holds
several stages (interleaved 1F1B) bisects one fraction of the way from each stage's lowest peak to its
unconstrained one, all its stages together. A rank whose lowest plans do not fit raises
`InfeasibleBudget` with its lowest predicted peak.

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

from planner.pipelining.optimize import optimize_pipeline
from planner.pipelining.report import PipelinePlan, StageReport

__all__ = ["PipelinePlan", "StageReport", "optimize_pipeline"]
