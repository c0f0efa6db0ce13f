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
- Gradients: before the first backward of the step no gradient exists (zero_grad(set_to_none=True));
  from it on, every parameter's `.grad` is alive and accumulates in place (the profiled graph made
  resident by `for_training_step`, NOTE [accumulated gradients] in micro_batches.py).

So at each action the peak is the single micro-batch's phase peak (forward or backward, with or
without resident gradients) with the stage's static bytes in place of one micro-batch's input,
plus `others` in-flight micro-batches' retained bytes and the held buffers. The optimizer step runs
after the last backward on the gradients alone, as for one micro-batch.

Which micro-batches are in flight at each action follows the schedule's action order
(`stage_actions`): GPipe runs every forward, then every backward; 1F1B runs min(n, S - s) forwards
(warmup), then alternates one backward and one forward, then the remaining backwards (cooldown), so
stage s holds min(S - s, n) micro-batches at its backwards and the last stage holds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from planner.ir import ActivationGraph, Phase, Schedule, SimulationResult
from planner.simulation.step import simulate

__all__ = [
    "Action",
    "PipelineSchedule",
    "StagePeak",
    "StageStatic",
    "in_flight_at_peak",
    "stage_actions",
    "stage_peak",
]


class PipelineSchedule(Enum):
    """The pipeline schedules whose action order this module knows."""

    GPIPE = "gpipe"
    """`torch.distributed.pipelining.ScheduleGPipe`: all forwards, then all backwards."""
    ONE_F_ONE_B = "1f1b"
    """`Schedule1F1B`: warmup forwards, one backward and one forward alternately, cooldown backwards."""


@dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch on one stage."""

    backward: bool
    micro_batch: int


def stage_actions(schedule: PipelineSchedule, *, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The order in which `stage` of `stages` runs its micro-batches' forwards and backwards."""
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(f"stage {stage} of {stages} with {micro_batches} micro-batches is not a pipeline")
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
    """Bytes a stage's rank holds through the whole step besides parameters and optimizer state."""

    batch_bytes: int
    """The stage's share of the whole batch: stage 0's inputs, the last stage's targets."""
    receive_bytes: int
    """The schedule's receive buffers: inputs (all but the first stage) and output gradients (all but
    the last), one per micro-batch."""
    output_bytes: int
    """One micro-batch's stage output, held from its forward to the end of its backward."""
    input_gradient_bytes: int
    """One micro-batch's input gradient, held by the pending send after a backward (0 on stage 0)."""


@dataclass(frozen=True)
class StagePeak:
    """A stage's predicted peak over one step of its schedule, and what sets it."""

    peak_bytes: int
    static_bytes: int
    """Parameters, buffers, optimizer state, the batch and the receive buffers."""
    retained_bytes: int
    """What one more micro-batch in flight adds (saved activations and its output)."""
    in_flight: int
    """Micro-batches in flight (forward done, backward not) at the action that sets the peak."""
    peak_action: str
    """"forward 3", "backward 0" or "optimizer step"."""
    recompute_ms: float
    """Recompute time of one micro-batch under the plan."""


def _phase_peaks(result: SimulationResult) -> tuple[int, int]:
    """(forward, backward) peak of one micro-batch's replay, recompute counted with backward."""
    forward = [step.live_bytes for step in result.trace if step.phase is Phase.FORWARD]
    backward = [step.live_bytes for step in result.trace if step.phase in (Phase.BACKWARD, Phase.RECOMPUTE)]
    return max(forward, default=0), max(backward, default=0)


def _after_backward_peak(result: SimulationResult) -> int:
    return max((step.live_bytes for step in result.trace if step.phase.after_backward), default=0)


def stage_peak(
    first: ActivationGraph,
    resident: ActivationGraph,
    schedule: Schedule,
    static: StageStatic,
    actions: list[Action],
) -> StagePeak:
    """Predicted peak of a stage whose one micro-batch is `first` (no gradient yet) or `resident` (every
    gradient alive: the same graph through `for_training_step`) under `schedule`, over `actions`
    (NOTE [stage memory]). The graphs' one-micro-batch input is replaced by `static`'s batch and
    buffers."""
    early, late = simulate(first, schedule), simulate(resident, schedule)
    replaced = static.batch_bytes + static.receive_bytes - first.static.input_bytes
    retained = late.retained_bytes + static.output_bytes
    peaks: list[tuple[int, int, str]] = []
    in_flight: set[int] = set()
    backward_done = False
    for action in actions:
        result = late if backward_done else early
        forward_bytes, backward_bytes = _phase_peaks(result)
        held = static.input_gradient_bytes if backward_done else 0
        others = len(in_flight - {action.micro_batch})
        if action.backward:
            phase_bytes = backward_bytes + static.output_bytes
            name = f"backward {action.micro_batch}"
        else:
            phase_bytes = forward_bytes
            name = f"forward {action.micro_batch}"
        peaks.append((phase_bytes + replaced + others * retained + held, others + 1, name))
        if action.backward:
            in_flight.discard(action.micro_batch)
            backward_done = True
        else:
            in_flight.add(action.micro_batch)
    peaks.append((_after_backward_peak(late) + replaced, 0, "optimizer step"))
    peak_bytes, flight, name = max(peaks, key=lambda entry: entry[0])
    return StagePeak(
        peak_bytes=peak_bytes,
        static_bytes=resident.static.resident_bytes - resident.static.resident_gradient_bytes + replaced,
        retained_bytes=retained,
        in_flight=flight,
        peak_action=name,
        recompute_ms=late.recompute_ms,
    )


def in_flight_at_peak(actions: list[Action]) -> int:
    """The most micro-batches in flight at any backward of `actions` (the count that sizes a stage)."""
    in_flight: set[int] = set()
    most = 0
    for action in actions:
        if action.backward:
            most = max(most, len(in_flight))
            in_flight.discard(action.micro_batch)
        else:
            in_flight.add(action.micro_batch)
    return most
