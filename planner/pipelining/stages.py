"""What each pipeline stage is profiled with, and the order in which its rank runs it.

Why it exists: a stage is planned like a model (`planner.profile`), but its example input is the
previous stage's output, its "loss" is the gradient it receives, and its rank holds buffers and
micro-batches a single model does not (NOTE [stage memory] in simulation/pipeline.py). This module
makes those from the stage modules and the example batch, and reads each rank's order of actions from
torch's own schedule code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from planner.ir import CostModel, MemoryCounting
from planner.profiler.cost_model import DeviceSpec
from planner.simulation.pipeline import Action, PipelineSchedule, StageStatic, stage_actions

__all__ = [
    "StageLoss",
    "cost_device",
    "last_output",
    "rank_actions",
    "ranks_of",
    "schedule_of",
    "stage_inputs",
    "stage_static",
]


def schedule_of(schedule: str | type | PipelineSchedule) -> PipelineSchedule:
    if isinstance(schedule, PipelineSchedule):
        return schedule
    names = {
        "ScheduleGPipe": PipelineSchedule.GPIPE,
        "Schedule1F1B": PipelineSchedule.ONE_F_ONE_B,
        "ScheduleInterleaved1F1B": PipelineSchedule.INTERLEAVED_1F1B,
    }
    if isinstance(schedule, type) and schedule.__name__ in names:
        return names[schedule.__name__]
    if isinstance(schedule, str) and schedule.lower() in {kind.value for kind in PipelineSchedule}:
        return PipelineSchedule(schedule.lower())
    raise ValueError(
        f"schedule={schedule!r}: optimize_pipeline plans 'gpipe', '1f1b' and 'interleaved_1f1b' (or "
        "ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B); zero-bubble and looped BFS schedules "
        "are not modelled yet"
    )


def ranks_of(kind: PipelineSchedule, stages: int, ranks: int | None) -> int:
    """The pipeline's ranks: one per stage, or for an interleaved schedule as given (stages % ranks == 0)."""
    if kind is not PipelineSchedule.INTERLEAVED_1F1B:
        if ranks not in (None, stages):
            raise ValueError(f"ranks={ranks!r}: a {kind.value} schedule holds one stage per rank ({stages})")
        return stages
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2 or stages % ranks:
        raise ValueError(
            f"ranks={ranks!r}: an interleaved schedule needs the pipeline's ranks, at least 2 and dividing "
            f"the {stages} stages (rank r holds stages r, r + ranks, ...)"
        )
    return ranks


def rank_actions(
    kind: PipelineSchedule, *, rank: int, ranks: int, stages: int, micro_batches: int
) -> list[Action]:
    """The forwards and backwards `rank` runs, in order, its stages numbered among its own. An
    interleaved rank's order is torch's: `ScheduleInterleaved1F1B._calculate_single_rank_operations`,
    run on an object that holds only the sizes it reads."""
    if kind is not PipelineSchedule.INTERLEAVED_1F1B:
        return stage_actions(kind, stage=rank, stages=stages, micro_batches=micro_batches)
    from torch.distributed.pipelining import schedules

    rounds = max(1, micro_batches // ranks)
    if micro_batches % rounds:
        raise ValueError(
            f"micro_batches={micro_batches}: interleaved 1F1B needs a multiple of its rounds ({rounds})"
        )
    sizes = object.__new__(schedules.ScheduleInterleaved1F1B)
    sizes.n_local_stages, sizes.pp_group_size, sizes._n_microbatches = (
        stages // ranks,
        ranks,
        micro_batches,
    )
    sizes.number_of_rounds, sizes.microbatches_per_round = (
        rounds,
        micro_batches // rounds,
    )
    computations = {
        schedules._ComputationType.FORWARD: False,
        schedules._ComputationType.FULL_BACKWARD: True,
    }
    return [
        Action(
            backward=computations[action.computation_type],
            micro_batch=int(action.microbatch_index or 0),
            stage=action.stage_index // ranks,
        )
        for action in sizes._calculate_single_rank_operations(rank)
        if action is not None and action.computation_type in computations
    ]


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
    def forward(ctx: Any, output: torch.Tensor, loss: StageLoss) -> torch.Tensor:
        ctx.gradient = loss.gradient if loss.gradient is not None else torch.ones_like(output)
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.gradient, None


class StageLoss:
    """A stage's `loss_fn(output)` for its profile: the schedule's loss on one micro-batch of targets
    (the last stage), else the received gradient's backward (`_ReceivedGradient`). `release` drops
    the example tensors once the stage is profiled, so the planned module, which keeps its profile,
    keeps no example alive on the stage's rank (measured: a micro-batch's input and the whole target
    batch a slice kept); later predictions at other shapes run on the meta device and make their own."""

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        target: Any,
        gradient: torch.Tensor | None,
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


def _tensor_bytes(values: Any, counting: MemoryCounting, copies: int = 1) -> int:
    """Bytes of `copies` tensors the shape of each tensor in `values`, as the schedule allocates them
    (its receive buffers, the batch it splits): the tensor's own elements, not the storage it may be a
    slice of (an example micro-batch cut from the batch)."""
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    return sum(counting.of(copies * tensor.numel() * tensor.element_size()) for tensor in tensors)


def stage_static(
    index: int, inputs: list[tuple[Any, ...]], outputs: list[tuple[Any, ...]], target: Any,
    micro_batches: int, counting: MemoryCounting,
) -> StageStatic:  # fmt: skip
    """What stage `index`'s rank holds besides its parameters (NOTE [stage memory])."""
    last = index == len(inputs) - 1
    # the whole batch is one tensor of n micro-batches, which the schedule splits into views
    batch_bytes = _tensor_bytes(inputs[0], counting, micro_batches) if index == 0 else 0
    if last and isinstance(target, torch.Tensor):
        batch_bytes += _tensor_bytes((target,), counting, micro_batches)
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
        sends_output=not last,
    )


def cost_device(
    stages: Sequence[torch.nn.Module],
    cost_model: CostModel,
    device: str | DeviceSpec | None,
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


def last_output(module: torch.nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    with torch.no_grad():
        output = module(*inputs)
    return output if isinstance(output, tuple) else (output,)
