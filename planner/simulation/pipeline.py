"""One pipeline stage's memory over a schedule's step: micro-batches in flight, buffers, gradients.

Why it exists: a stage of a `torch.distributed.pipelining` schedule runs the forwards and backwards of
many micro-batches in an order the schedule fixes, so its peak is not one micro-batch's. The simulator
(step.py) predicts one micro-batch; this module walks the schedule's actions for one stage and adds,
at each action, what the other micro-batches in flight and the schedule's own buffers hold. It is
torch-free, like the rest of simulation/.

NOTE [stage memory]: what torch.distributed.pipelining (torch 2.13, stage.py and schedules.py) keeps
on the rank of stage s of S, over a step of n micro-batches:

- Before the step: the stage's parameters and optimizer state; the whole batch where the stage reads
  it (stage 0's inputs, the last stage's targets); and the receive buffers `_prepare_forward_infra`
  and `_setup_backward_recv_info` allocate once and keep for every later step: one buffer per
  micro-batch for the stage's input (every stage but the first) and one per micro-batch for the
  gradient of its output (every stage but the last). `StageStatic` holds them.
- A micro-batch is in flight from its forward to its backward: `fwd_cache` keeps its stage output
  (and its input, a receive buffer already counted), and autograd keeps what the forward saved. Its
  bytes are the simulator's `retained_bytes` (what is alive between forward and backward) plus the
  output, which the single-micro-batch replay frees after the loss.
- The micro-batch whose backward runs holds its output until its backward ends (`fwd_cache.pop`
  returns it to the backward's frame).
- After a backward, the input gradient it computed stays referenced by the pending send
  (`bwd_sends` in Schedule1F1B's loop) through the next forward and backward: one input's bytes on
  every stage but the first, from its first backward on.
- Gradients: before a stage's first backward of the step no gradient of its parameters exists
  (zero_grad(set_to_none=True)); from it on, every one is alive and accumulates in place (the
  profiled graph made resident by `for_training_step`, NOTE [accumulated gradients] in
  micro_batches.py).
- Schedules with several stages per rank (interleaved 1F1B) run on `_PipelineScheduleRuntime`, which
  keeps every send's work in `send_ops` until the step's last action, and a gloo send's work holds its
  tensor: each output a stage sends stays alive from its forward to the end of the step, and each input
  gradient from its backward (`sends_held`).

So at each action of a rank the peak is the acting stage's single micro-batch phase peak (forward
or backward, with or without resident gradients), plus every local stage's static bytes (its own
input replaced by the batch and receive buffers), the other local stages' gradients, every
in-flight micro-batch's retained bytes and the held buffers (`rank_peak`). The optimizer step runs
after the last backward on the gradients alone.

Which micro-batches are in flight at each action follows the schedule's action order
(`stage_actions`): GPipe runs every forward, then every backward; 1F1B runs min(n, S - s) forwards
(warmup), then alternates one backward and one forward, then the remaining backwards (cooldown), so
stage s holds min(S - s, n) micro-batches at its backwards and the last stage holds one. An
interleaved rank's order is torch's own (`ScheduleInterleaved1F1B._calculate_single_rank_operations`,
read in planner/pipelining/stages.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from planner.ir import ActivationGraph, Phase, Schedule, SimulationResult
from planner.simulation.step import simulate

__all__ = [
    "Action",
    "PipelineSchedule",
    "RankPeak",
    "StageModel",
    "StageStatic",
    "in_flight_at_peak",
    "rank_peak",
    "stage_actions",
]


class PipelineSchedule(Enum):
    """The pipeline schedules whose memory this module models."""

    GPIPE = "gpipe"
    """`torch.distributed.pipelining.ScheduleGPipe`: all forwards, then all backwards."""
    ONE_F_ONE_B = "1f1b"
    """`Schedule1F1B`: warmup forwards, one backward and one forward alternately, cooldown backwards."""
    INTERLEAVED_1F1B = "interleaved_1f1b"
    """`ScheduleInterleaved1F1B`: several stages per rank (rank r holds stages r, r + R, ...), 1F1B
    over them depth first; its sends are held to the end of the step."""

    @property
    def sends_held(self) -> bool:
        """Whether the schedule keeps every send's work, and so its tensor, to the end of the step."""
        return self is PipelineSchedule.INTERLEAVED_1F1B


@dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch on one of a rank's stages."""

    backward: bool
    micro_batch: int
    stage: int = 0
    """The stage's position among the rank's stages (0 where a rank holds one)."""


def stage_actions(schedule: PipelineSchedule, *, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The order in which `stage` of `stages` runs its micro-batches' forwards and backwards."""
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(f"stage {stage} of {stages} with {micro_batches} micro-batches is not a pipeline")
    if schedule is PipelineSchedule.INTERLEAVED_1F1B:
        raise ValueError("an interleaved rank's actions are torch's: planner/pipelining/stages.py reads them")
    forwards = [Action(False, index) for index in range(micro_batches)]
    backwards = [Action(True, index) for index in range(micro_batches)]
    if schedule is PipelineSchedule.GPIPE:
        return forwards + backwards
    warmup = min(micro_batches, stages - stage)
    actions = forwards[:warmup]
    for index in range(micro_batches - warmup):
        actions += [backwards[index], forwards[warmup + index]]
    return actions + backwards[micro_batches - warmup :]


@dataclass(frozen=True)
class StageStatic:
    """Bytes a stage's rank holds for it besides parameters and optimizer state."""

    batch_bytes: int
    """The stage's share of the whole batch: stage 0's inputs, the last stage's targets."""
    receive_bytes: int
    """The schedule's receive buffers: inputs (all but the first stage) and output gradients (all but
    the last), one per micro-batch."""
    output_bytes: int
    """One micro-batch's stage output, held from its forward to the end of its backward."""
    input_gradient_bytes: int
    """One micro-batch's input gradient, held by the pending send after a backward (0 on stage 0)."""
    sends_output: bool = True
    """Whether the stage sends its output (every stage but the last)."""


@dataclass(frozen=True)
class StageModel:
    """One stage on a rank under one plan: its micro-batch graph before any backward of the step
    (`first`) and with every gradient alive (`resident`, `for_training_step`), the plan, and what the
    schedule holds for it."""

    first: ActivationGraph
    resident: ActivationGraph
    schedule: Schedule
    static: StageStatic


@dataclass(frozen=True)
class RankPeak:
    """A rank's predicted peak over one step of its schedule, and what sets it."""

    peak_bytes: int
    retained_bytes: tuple[int, ...]
    """What one more micro-batch in flight adds, per local stage (saved activations, and its output
    where nothing else holds it)."""
    in_flight: tuple[int, ...]
    """Micro-batches in flight (forward done, backward not) per local stage at the peak."""
    peak_action: str
    """"forward 3", "backward 0" or "optimizer step", with "of local stage k" where the rank holds
    several stages (k counts the rank's own stages from 0)."""
    recompute_ms: tuple[float, ...]
    """Recompute time of one micro-batch under each local stage's plan."""


def _phase_peaks(result: SimulationResult) -> tuple[int, int, int]:
    """(forward, backward, after backward) peak of one micro-batch's replay, recompute in backward."""
    forward = [step.live_bytes for step in result.trace if step.phase is Phase.FORWARD]
    backward = [step.live_bytes for step in result.trace if step.phase in (Phase.BACKWARD, Phase.RECOMPUTE)]
    after = [step.live_bytes for step in result.trace if step.phase.after_backward]
    return max(forward, default=0), max(backward, default=0), max(after, default=0)


def _state_bytes(graph: ActivationGraph) -> int:
    """Parameters, buffers, the micro-batch input and optimizer state: a replay's static bytes but
    gradients."""
    static = graph.static
    return static.parameter_bytes + static.buffer_bytes + static.input_bytes + static.optimizer_state_bytes


@dataclass
class _Replays:
    """One local stage's replays and the bytes the walk adds for it."""

    model: StageModel
    early: tuple[int, int, int]
    late: tuple[int, int, int]
    base_bytes: int
    """Parameters, buffers, optimizer state, batch and receive buffers."""
    retained_bytes: int
    recompute_ms: float
    in_flight: set[int]
    forwards: int = 0
    backwards: int = 0

    @classmethod
    def of(cls, model: StageModel, sends_held: bool) -> _Replays:
        early, late = (
            simulate(model.first, model.schedule),
            simulate(model.resident, model.schedule),
        )
        static = model.static
        state = _state_bytes(model.resident) - model.resident.static.input_bytes
        output_elsewhere = sends_held and static.sends_output  # the send holds it (NOTE [stage memory])
        return cls(
            model=model,
            early=_phase_peaks(early),
            late=_phase_peaks(late),
            base_bytes=state + static.batch_bytes + static.receive_bytes,
            retained_bytes=late.retained_bytes + (0 if output_elsewhere else static.output_bytes),
            recompute_ms=late.recompute_ms,
            in_flight=set(),
        )

    def gradient_bytes(self) -> int:
        return self.model.resident.static.accumulated_gradient_bytes if self.backwards else 0

    def held_bytes(self, sends_held: bool) -> int:
        """Sent outputs and input gradients still referenced (NOTE [stage memory])."""
        static = self.model.static
        if sends_held:
            outputs = self.forwards * static.output_bytes if static.sends_output else 0
            return outputs + self.backwards * static.input_gradient_bytes
        return static.input_gradient_bytes if self.backwards else 0

    def phase_bytes(self, action: Action, sends_held: bool) -> int:
        """The acting stage's replay at this action, less its state (gradients kept)."""
        forward, backward, _ = self.late if self.backwards else self.early
        if not action.backward:
            return forward - _state_bytes(self.model.first)
        output_bytes = 0 if sends_held and self.model.static.sends_output else self.model.static.output_bytes
        return backward - _state_bytes(self.model.first) + output_bytes


def rank_peak(stages: list[StageModel], actions: list[Action], *, sends_held: bool = False) -> RankPeak:
    """Predicted peak of a rank holding `stages`, over its `actions` (NOTE [stage memory]);
    `sends_held` for schedules that keep every send's work to the end of the step."""
    replays = [_Replays.of(model, sends_held) for model in stages]
    peaks: list[tuple[int, tuple[int, ...], str]] = []
    for action in actions:
        acting = replays[action.stage]
        total = acting.phase_bytes(action, sends_held)
        for index, replay in enumerate(replays):
            others = replay.in_flight - ({action.micro_batch} if index == action.stage else set())
            total += replay.base_bytes + len(others) * replay.retained_bytes + replay.held_bytes(sends_held)
            if index != action.stage:
                total += replay.gradient_bytes()
        flight = tuple(len(replay.in_flight | ({action.micro_batch} if i == action.stage else set()))
                       for i, replay in enumerate(replays))  # fmt: skip
        name = f"{'backward' if action.backward else 'forward'} {action.micro_batch}"
        if len(replays) > 1:
            name += f" of local stage {action.stage}"
        peaks.append((total, flight, name))
        if action.backward:
            acting.in_flight.discard(action.micro_batch)
            acting.backwards += 1
        else:
            acting.in_flight.add(action.micro_batch)
            acting.forwards += 1
    optimizer_bytes = sum(replay.base_bytes + replay.gradient_bytes() for replay in replays) + max(
        replay.late[2]
        - _state_bytes(replay.model.resident)
        - replay.model.resident.static.resident_gradient_bytes
        for replay in replays
    )
    peaks.append((optimizer_bytes, tuple(0 for _ in replays), "optimizer step"))
    peak_bytes, flight, name = max(peaks, key=lambda entry: entry[0])
    return RankPeak(
        peak_bytes=peak_bytes,
        retained_bytes=tuple(replay.retained_bytes for replay in replays),
        in_flight=flight,
        peak_action=name,
        recompute_ms=tuple(replay.recompute_ms for replay in replays),
    )


def in_flight_at_peak(actions: list[Action], stage: int = 0) -> int:
    """The most micro-batches of local `stage` in flight at any of its backwards (the count that sizes
    it)."""
    in_flight: set[int] = set()
    most = 0
    for action in actions:
        if action.stage != stage:
            continue
        if action.backward:
            most = max(most, len(in_flight))
            in_flight.discard(action.micro_batch)
        else:
            in_flight.add(action.micro_batch)
    return most
