"""Per-stage plans for torch.distributed.pipelining, measured in real gloo processes on the CPU.

Each measured test runs a small transformer split into stages with `optimize_pipeline`'s plans, at a
budget the unplanned first stage overflows, in one gloo process per stage
(planner/testing/pipeline_stages.py), and checks on every rank: the measured peak of the second step
(everything alive at its start counted, 512-byte blocks) is within the budget and within 2 % of the
stage's prediction, and the first step's loss and gradients equal the unplanned pipeline's, computed
in this process micro-batch by micro-batch in the schedule's order of accumulation (a second gloo run
would double the test's time).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.errors import InfeasibleBudget
from planner.simulation.pipeline import (
    PipelineSchedule,
    in_flight_at_peak,
    stage_actions,
)
from planner.testing.pipeline_stages import (
    PipelineConfig,
    build_stages,
    example_batch,
    gradient_difference,
    plan_pipeline,
    planned_stage,
    reference_step,
    run_pipeline,
    token_loss,
)
from planner.testing.ranks import free_port

PREDICTION_TOLERANCE = 0.02
"""Predicted stage peak against measured, relative to measured (issue 37's done-when)."""
BUDGET_FRACTION = 0.8
"""The budget, as a fraction of the highest unplanned stage's predicted peak: the first stage must
recompute to fit, the last need not."""


@pytest.mark.parametrize(
    ("schedule", "stages", "micro_batches"),
    [
        (PipelineSchedule.ONE_F_ONE_B, 4, 6),
        (PipelineSchedule.ONE_F_ONE_B, 4, 2),
        (PipelineSchedule.GPIPE, 3, 5),
    ],
)
def test_in_flight_counts(schedule: PipelineSchedule, stages: int, micro_batches: int) -> None:
    """1F1B: stage s of S holds min(S - s, n) micro-batches at its backwards; GPipe: all n."""
    for stage in range(stages):
        actions = stage_actions(schedule, stage=stage, stages=stages, micro_batches=micro_batches)
        assert sorted((a.backward, a.micro_batch) for a in actions) == sorted(
            (backward, index) for backward in (False, True) for index in range(micro_batches)
        ), f"stage {stage}: every micro-batch runs one forward and one backward: {actions}"
        expected = micro_batches if schedule is PipelineSchedule.GPIPE else min(stages - stage, micro_batches)
        assert in_flight_at_peak(actions) == expected, f"stage {stage} of {stages}: {actions}"


@pytest.mark.parametrize(("stages", "micro_batches"), [(4, 6), (4, 4), (3, 2), (2, 5)])
@pytest.mark.parametrize("schedule", [PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B])
def test_actions_follow_torch(schedule: PipelineSchedule, stages: int, micro_batches: int) -> None:
    """Each stage's forwards and backwards run in the order of torch's own schedule IR
    (`_get_pipeline_order`, the action lists the schedule documents itself with). Forwards are
    numbered in the order they run: torch 2.13's 1F1B IR numbers the last stage's forwards from 1
    (its steady state increments `forward_mb` before the first one), where its executed loop runs
    micro-batch 0 first."""
    from torch.distributed.pipelining import schedules

    kinds = {
        PipelineSchedule.GPIPE: schedules.ScheduleGPipe,
        PipelineSchedule.ONE_F_ONE_B: schedules.Schedule1F1B,
    }
    torch_schedule = object.__new__(kinds[schedule])
    torch_schedule._num_stages, torch_schedule._n_microbatches = stages, micro_batches
    order = torch_schedule._get_pipeline_order()
    for stage in range(stages):
        torch_actions, forwards = [], 0
        for action in order[stage]:
            if action is None:
                continue
            if action.computation_type is schedules._ComputationType.FORWARD:
                torch_actions.append((False, forwards))
                forwards += 1
            elif action.computation_type is schedules._ComputationType.FULL_BACKWARD:
                torch_actions.append((True, action.microbatch_index))
        ours = stage_actions(schedule, stage=stage, stages=stages, micro_batches=micro_batches)
        assert [(action.backward, action.micro_batch) for action in ours] == torch_actions, f"stage {stage}"


def unplanned_peak_bytes(config: PipelineConfig) -> int:
    """The highest predicted stage peak without checkpointing (measured within 2 % of it in
    bench/results/pipeline.json's "none" rows)."""
    unplanned = plan_pipeline(config, 2**40)
    assert all(report.recompute_ms == 0 for report in unplanned.stages)
    return max(report.predicted_peak_bytes for report in unplanned.stages)


def _budget(config: PipelineConfig) -> int:
    return int(BUDGET_FRACTION * unplanned_peak_bytes(config))


@pytest.mark.parametrize(
    "config",
    [
        PipelineConfig(stages=2, schedule="1f1b"),
        PipelineConfig(stages=2, schedule="gpipe"),
        PipelineConfig(stages=4, schedule="1f1b"),
        PipelineConfig(stages=4, ranks=2, schedule="interleaved_1f1b"),
    ],
    ids=["2-stage-1f1b", "2-stage-gpipe", "4-stage-1f1b", "2-rank-interleaved"],
)
def test_measured_stage_peaks(config: PipelineConfig) -> None:
    torch.set_num_threads(1)
    budget = _budget(config)
    pipeline = plan_pipeline(config, budget)
    assert pipeline.stages[0].recompute_ms > 0, (
        f"the first stage must recompute at this budget:\n{pipeline.summary()}"
    )
    if config.schedule == "1f1b":
        assert pipeline.stages[-1].recompute_ms == 0, (
            f"1F1B's last stage holds one micro-batch:\n{pipeline.summary()}"
        )
    unplanned = reference_step(config)
    planned = run_pipeline(config, functools.partial(planned_stage, config, budget))
    rank_reports = [next(r for r in pipeline.stages if r.rank == rank) for rank in range(config.processes)]
    for report, measured, reference in zip(rank_reports, planned, unplanned, strict=True):
        predicted = report.predicted_peak_bytes
        where = f"rank {report.rank}: measured {measured.peak_bytes:,}, predicted {predicted:,}, "
        where += f"budget {budget:,}"
        assert measured.peak_bytes <= budget, where
        assert abs(predicted - measured.peak_bytes) <= PREDICTION_TOLERANCE * measured.peak_bytes, where
        assert measured.loss == reference.loss, where
        assert gradient_difference(measured, reference) <= 1e-6, where
    assert planned[0].peak_bytes < budget < unplanned_peak_bytes(config)


def _plan_in_rank(rank: int, world_size: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        config = PipelineConfig(stages=2)
        tokens, targets = example_batch(config)
        from planner.pipelining import optimize_pipeline

        plans = {}
        for name, group in (("alone", None), ("broadcast", dist.group.WORLD)):
            plans[name] = optimize_pipeline(
                build_stages(config), (tokens[: config.micro_batch],), schedule="1f1b",
                micro_batches=config.micro_batches, budget_bytes=5_400_000, loss_fn=token_loss,
                example_target=targets[: config.micro_batch], process_group=group,
                cost_model="measured" if name == "broadcast" else "analytic",
            ).to_json()  # fmt: skip
        Path(out, f"rank{rank}.json").write_text(json.dumps(plans))
    finally:
        dist.destroy_process_group()


def test_one_plan_on_every_rank() -> None:
    """The same inputs give the same plans bit for bit in every process: analytic times and dp alone,
    and rank 0's plan broadcast where measured node times differ between processes."""
    world_size = 3
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _plan_in_rank,
            args=(world_size, free_port(), out),
            nprocs=world_size,
            start_method="spawn",
        )
        plans = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(world_size)]
    assert all(plan == plans[0] for plan in plans), "ranks planned differently"
    here = plan_pipeline(PipelineConfig(stages=2), 5_400_000).to_json()
    assert plans[0]["alone"] == here, "a rank planned differently from this process"
    assert json.loads(here)["schedules"][0] != json.loads(here)["schedules"][1]


def test_infeasible_stage_names_it() -> None:
    config = PipelineConfig(stages=2)
    with pytest.raises(InfeasibleBudget, match="pipeline rank 0"):
        plan_pipeline(config, 2_000_000)


def test_the_plot_shows_every_rank(tmp_path: Path) -> None:
    pipeline = plan_pipeline(PipelineConfig(stages=2), 2**40)
    assert pipeline.plot(tmp_path / "stages.png").stat().st_size > 0


def test_data_parallel_stages_hold_their_share_of_the_state() -> None:
    """Each stage data parallel over 2 ranks: FSDP2 splits the stage's parameters and optimizer state
    (about half each, shards padded and Adam's step scalars whole), DDP adds its gradient buckets."""
    config = PipelineConfig(stages=2)
    whole = plan_pipeline(config, 2**40)
    fsdp = plan_pipeline(config, 2**40, world_size=2, sharding="fsdp")
    ddp = plan_pipeline(config, 2**40, world_size=2, sharding="ddp")
    for alone, sharded, replicated in zip(whole.stages, fsdp.stages, ddp.stages, strict=True):
        share = sharded.parameter_state_bytes / alone.parameter_state_bytes
        assert 0.45 < share < 0.6, f"stage {alone.stage}: FSDP2 holds {share:.0%} of the state"
        assert replicated.predicted_peak_bytes > alone.predicted_peak_bytes, f"stage {alone.stage}: buckets"
