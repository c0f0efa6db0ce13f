"""`PipelinePlan` and `StageReport`: what `optimize_pipeline` returns, one plan and one report per stage.

Plain data and its presentation (the per-stage table, the rank that sets the step time, the JSON rank 0
broadcasts, NOTE [one plan on every rank] in planner/pipelining/__init__.py); no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from planner.errors import format_bytes
from planner.planning.plan import Plan
from planner.serialize import schedule_to_dict
from planner.simulation.pipeline import PipelineSchedule

__all__ = ["PipelinePlan", "StageReport"]


@dataclass(frozen=True)
class StageReport:
    """One stage's predicted memory and time under its plan (bytes in the plan's counting)."""

    stage: int
    rank: int
    """The pipeline rank that holds the stage (stage % ranks)."""
    in_flight: int
    """Micro-batches of this stage in flight at its rank's peak (forward done, backward not)."""
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
    """The predicted peak of the stage's rank (every stage it holds)."""
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
    def ranks(self) -> int:
        return max(report.rank for report in self.stages) + 1

    def rank_micro_batch_ms(self, rank: int) -> float:
        """One micro-batch through every stage `rank` holds: forward, backward and recompute."""
        return sum(report.micro_batch_ms for report in self.stages if report.rank == rank)

    @property
    def bottleneck_rank(self) -> int:
        """The rank with the longest micro-batch time, which every other rank waits for."""
        return max(range(self.ranks), key=self.rank_micro_batch_ms)

    @property
    def predicted_step_ms(self) -> float:
        """The schedule's step time on the profile's node times: n + (R - 1) / v micro-batches of the
        slowest rank, for R ranks of v stages each (GPipe and 1F1B run n micro-batches through R
        stages in n + R - 1 slots of the slowest; interleaving v stages per rank shrinks the bubble
        v-fold)."""
        local_stages = len(self.stages) // self.ranks
        slots = self.micro_batches + (self.ranks - 1) / local_stages
        return slots * self.rank_micro_batch_ms(self.bottleneck_rank)

    def summary(self) -> str:
        """The per-stage report, as text (every figure predicted)."""
        lines = [
            (
                f"{self.schedule.value} pipeline, {len(self.stages)} stages on {self.ranks} ranks, "
                f"{self.micro_batches} micro-batches, budget {format_bytes(self.budget_bytes)} per device "
                "(all figures predicted)"
            ),
            "stage  rank  in flight  params+optimizer  buffers     per micro-batch  rank peak   recompute/mb",
        ]
        for report in self.stages:
            lines.append(
                f"{report.stage:>5}  {report.rank:>4}  {report.in_flight:>9}  "
                f"{format_bytes(report.parameter_state_bytes):>16}  "
                f"{format_bytes(report.buffer_bytes):>10}  {format_bytes(report.retained_bytes):>15}  "
                f"{format_bytes(report.predicted_peak_bytes):>10}  {report.recompute_ms:>9.2f} ms"
            )
        lines.append(self.balance_note())
        return "\n".join(lines)

    def balance_note(self) -> str:
        """Which rank sets the step time and whether its recompute could be relieved."""
        slowest = self.bottleneck_rank
        recompute_ms = sum(report.recompute_ms for report in self.stages if report.rank == slowest)
        note = (
            f"rank {slowest} sets the step time: {self.rank_micro_batch_ms(slowest):.2f} ms per micro-batch "
            f"({recompute_ms:.2f} ms of it recompute), predicted step {self.predicted_step_ms:.1f} ms"
        )
        if recompute_ms <= 0:
            return note + "; no rank recomputes on the critical path."
        spare = [
            rank
            for rank in range(self.ranks)
            if rank != slowest
            and self.rank_micro_batch_ms(rank) + recompute_ms <= self.rank_micro_batch_ms(slowest)
        ]
        if spare:
            note += (
                f"; ranks {spare} have time to spare: moving a block from rank {slowest} to one of them "
                "(or a larger budget there) would shorten the step"
            )
        return note + "."

    def plot(self, path: str | Path) -> Path:
        """Save each rank's predicted peak, stacked by what holds it, against the budget, with its
        recompute per micro-batch (.png, .svg or .pdf; needs matplotlib)."""
        from planner.report.plots import RankBar, plot_pipeline

        bars = []
        for rank in range(self.ranks):
            held = [report for report in self.stages if report.rank == rank]
            stages = ", ".join(str(report.stage) for report in held)
            bars.append(
                RankBar(
                    label=f"rank {rank}\nstage{'s' if len(held) > 1 else ''} {stages}",
                    state_bytes=sum(report.parameter_state_bytes for report in held),
                    buffer_bytes=sum(report.buffer_bytes for report in held),
                    in_flight_bytes=sum(report.in_flight * report.retained_bytes for report in held),
                    peak_bytes=held[0].predicted_peak_bytes,
                    recompute_ms=sum(report.recompute_ms for report in held),
                )
            )
        title = (
            f"{self.schedule.value}, {len(self.stages)} stages on {self.ranks} ranks, {self.micro_batches} "
            "micro-batches (predicted)"
        )
        return plot_pipeline(bars, path, budget_bytes=self.budget_bytes, title=title)

    def to_json(self) -> str:
        """The chosen schedules and reports, what rank 0 broadcasts (NOTE [one plan on every rank])."""
        return json.dumps(
            {
                "schedules": [schedule_to_dict(plan.schedule) for plan in self.plans],
                "stages": [dataclasses.asdict(report) for report in self.stages],
            },
            sort_keys=True,
        )
