"""A small transformer split into pipeline stages, and a gloo run of it that measures each rank.

Why it exists: a per-stage plan (planner/pipelining/) is only as good as its prediction of what
each rank of a real `torch.distributed.pipelining` schedule holds. The tests and bench/pipeline.py
run the same experiment: every rank builds the same seeded model, takes its stage (torchtitan's
manual split: embedding and the first blocks, blocks, the last blocks with the norm and head), wraps
it in a `PipelineStage`, runs a schedule on the CPU with the gloo backend, and measures its peak
with the live-storage tracker (profiler/counting.py), counting every tensor alive when the step
starts (parameters, Adam's state, the schedule's receive buffers, the batch). The measured step is
the second, so the receive buffers and the optimizer state exist before it, as in training.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from planner.profiler.counting import LiveStorageTracker
from planner.testing.ranks import free_port

__all__ = [
    "PipelineConfig",
    "RankRecord",
    "StageSpec",
    "TinyBlock",
    "build_stages",
    "checkpointed_blocks",
    "example_batch",
    "gradient_difference",
    "plan_pipeline",
    "planned_stage",
    "reference_step",
    "run_pipeline",
    "time_pipelines",
    "token_loss",
]

SEED = 1234
"""Seed of the model's parameters and of the batch, the same on every rank."""


@dataclass(frozen=True)
class PipelineConfig:
    """The model, the batch and the schedule of one pipeline run."""

    stages: int = 2
    blocks: int = 4
    width: int = 64
    heads: int = 4
    vocabulary: int = 128
    sequence: int = 64
    micro_batch: int = 4
    micro_batches: int = 4
    schedule: str = "1f1b"
    learning_rate: float = 1e-3
    ranks: int = 0
    """Processes; 0: one per stage. An interleaved schedule's rank r holds stages r, r + ranks, ..."""

    @property
    def processes(self) -> int:
        return self.ranks or self.stages

    def local_stages(self, rank: int) -> list[int]:
        """The stages `rank` holds."""
        return list(range(rank, self.stages, self.processes))


class TinyBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP four times as wide."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.reshape(batch, sequence, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, sequence, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Stage(nn.Module):
    """One stage of the split: an optional embedding, blocks, an optional norm and head."""

    def __init__(
        self,
        embedding: nn.Embedding | None,
        blocks: Sequence[TinyBlock],
        head: nn.Sequential | None,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


@dataclass(frozen=True)
class StageSpec:
    """Which blocks a stage holds (and so which parameters), for the split of a `PipelineConfig`."""

    first_block: int
    stop_block: int


def stage_specs(config: PipelineConfig) -> list[StageSpec]:
    """Blocks split evenly over the stages, the first stages taking one more where they do not divide."""
    per, extra = divmod(config.blocks, config.stages)
    specs, start = [], 0
    for stage in range(config.stages):
        stop = start + per + (1 if stage < extra else 0)
        specs.append(StageSpec(start, stop))
        start = stop
    return specs


def build_stages(config: PipelineConfig) -> list[nn.Module]:
    """The seeded model, split into `config.stages` stage modules (the same on every call)."""
    torch.manual_seed(SEED)
    embedding = nn.Embedding(config.vocabulary, config.width)
    blocks = [TinyBlock(config.width, config.heads) for _ in range(config.blocks)]
    head = nn.Sequential(nn.LayerNorm(config.width), nn.Linear(config.width, config.vocabulary))
    specs = stage_specs(config)
    last = len(specs) - 1
    return [
        Stage(
            embedding if index == 0 else None,
            blocks[spec.first_block : spec.stop_block],
            head if index == last else None,
        )
        for index, spec in enumerate(specs)
    ]


def example_batch(config: PipelineConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of the whole batch: `micro_batches` micro-batches of `micro_batch` sequences."""
    generator = torch.Generator().manual_seed(SEED)
    rows = config.micro_batch * config.micro_batches
    tokens = torch.randint(config.vocabulary, (rows, config.sequence), generator=generator)
    targets = torch.randint(config.vocabulary, (rows, config.sequence), generator=generator)
    return tokens, targets


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token, the schedule's `loss_fn(output, target)`."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class RankRecord:
    """What one rank measured over its second training step."""

    rank: int
    peak_bytes: int
    """Peak of live storages over the step in 512-byte blocks, everything alive at its start included."""
    start_bytes: int
    """Live bytes when the step started (parameters, optimizer state, buffers, the batch)."""
    loss: float | None
    """The first step's mean loss over micro-batches (the last rank only)."""
    gradients: dict[str, list[float]] = field(default_factory=dict)
    """Every parameter's gradient after the first step, flattened."""


StageWrapper = Callable[[int, nn.Module], nn.Module]
"""(stage index, stage module) -> the module its rank trains: a plan's module, or a hand policy."""


def plan_pipeline(
    config: PipelineConfig, budget_bytes: int, stages: list[nn.Module] | None = None, **data_parallel: Any
) -> Any:
    """`planner.optimize_pipeline` for `config`'s stages (built afresh unless given) at `budget_bytes`;
    `data_parallel` are its `world_size`, `sharding` and `reshard_after_forward`."""
    from planner.pipelining import optimize_pipeline

    stages = build_stages(config) if stages is None else stages
    tokens, targets = example_batch(config)
    return optimize_pipeline(
        stages,
        (tokens[: config.micro_batch],),
        schedule=config.schedule,
        micro_batches=config.micro_batches,
        budget_bytes=budget_bytes,
        loss_fn=token_loss,
        example_target=targets[: config.micro_batch],
        ranks=config.ranks or None,
        **data_parallel,
    )


def planned_stage(config: PipelineConfig, budget_bytes: int, stage: int, module: nn.Module) -> nn.Module:
    """A `StageWrapper`: `stage` as `optimize_pipeline` plans it, every rank planning alike."""
    stages = build_stages(config)
    stages[stage] = module
    return plan_pipeline(config, budget_bytes, stages).plans[stage].module


def checkpointed_blocks(first_blocks: int | None, stage: int, module: nn.Module) -> nn.Module:
    """A `StageWrapper`: the hand policy, non-reentrant `checkpoint_wrapper` on the stage's first
    `first_blocks` blocks (every block when None), the same on every stage."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    assert isinstance(module, Stage)
    count = len(module.blocks) if first_blocks is None else min(first_blocks, len(module.blocks))
    for index in range(count):
        module.blocks[index] = checkpoint_wrapper(module.blocks[index])
    return module


def _schedule(config: PipelineConfig, stages: list[Any]) -> Any:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    if config.schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, config.micro_batches, loss_fn=token_loss)
    kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    (stage,) = stages
    return kinds[config.schedule](stage, config.micro_batches, loss_fn=token_loss)


def _local_pipeline(
    config: PipelineConfig, rank: int, wrapper: StageWrapper | None
) -> tuple[list[nn.Module], Any]:
    """The stage modules `rank` trains (the originals, whose parameters they share) and its schedule."""
    from torch.distributed.pipelining import PipelineStage

    built = build_stages(config)
    originals = [built[stage] for stage in config.local_stages(rank)]
    pipeline_stages = []
    for stage, module in zip(config.local_stages(rank), originals, strict=True):
        trained = wrapper(stage, module) if wrapper is not None else module
        pipeline_stages.append(PipelineStage(trained, stage, config.stages, torch.device("cpu")))
    return originals, _schedule(config, pipeline_stages)


def _live_tensors() -> list[torch.Tensor]:
    """Every CPU tensor the garbage collector can see (what exists before the step)."""
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        found = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return [tensor for tensor in found if tensor.device.type == "cpu"]


def _rank_main(rank: int, config: PipelineConfig, wrapper: StageWrapper | None, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=config.processes)
    try:
        modules, schedule = _local_pipeline(config, rank, wrapper)
        optimizer = torch.optim.Adam(
            [p for module in modules for p in module.parameters()],
            lr=config.learning_rate,
        )
        tokens, targets = example_batch(config)
        first, last = (
            0 in config.local_stages(rank),
            config.stages - 1 in config.local_stages(rank),
        )

        def step() -> list[torch.Tensor]:
            losses: list[torch.Tensor] = []
            optimizer.zero_grad(set_to_none=True)
            args = (tokens,) if first else ()
            schedule.step(
                *args,
                target=targets if last else None,
                losses=losses,
                return_outputs=False,
            )
            optimizer.step()
            return losses

        losses = step()
        gradients = {
            f"{stage}.{name}": parameter.grad.flatten().tolist()
            for stage, module in zip(config.local_stages(rank), modules, strict=True)
            for name, parameter in module.named_parameters()
            if parameter.grad is not None
        }
        gc.collect()
        tracker = LiveStorageTracker()
        tracker.track(_live_tensors())
        start_bytes = tracker.live_bytes
        with tracker:
            step()
        record = RankRecord(
            rank=rank,
            peak_bytes=tracker.peak_bytes,
            start_bytes=start_bytes,
            loss=float(torch.stack(losses).detach().mean()) if losses else None,
            gradients=gradients,
        )
        Path(out, f"rank{rank}.json").write_text(json.dumps(asdict(record)))
    finally:
        dist.destroy_process_group()


def run_pipeline(config: PipelineConfig, wrapper: StageWrapper | None = None) -> list[RankRecord]:
    """Run two steps of `config`'s pipeline in gloo processes, each rank training `wrapper(stage,
    module)` for each stage it holds (the stage module when None); what each rank measured.
    `wrapper` must be picklable (a module-level function or a `functools.partial` of one)."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank_main,
            args=(config, wrapper, free_port(), out),
            nprocs=config.processes,
            start_method="spawn",
        )
        return [
            RankRecord(**json.loads(Path(out, f"rank{r}.json").read_text())) for r in range(config.processes)
        ]


def _time_main(rank: int, config: PipelineConfig, wrappers: dict[str, StageWrapper | None], rounds: int,
               port: int, out: str) -> None:  # fmt: skip
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=config.processes)
    try:
        tokens, targets = example_batch(config)
        first, last = (
            0 in config.local_stages(rank),
            config.stages - 1 in config.local_stages(rank),
        )
        steps: dict[str, Callable[[], None]] = {}
        for name, wrapper in wrappers.items():
            modules, schedule = _local_pipeline(config, rank, wrapper)
            parameters = [p for module in modules for p in module.parameters()]
            optimizer = torch.optim.Adam(parameters, lr=config.learning_rate)
            steps[name] = functools.partial(_train_step, schedule, optimizer, tokens if first else None,
                                            targets if last else None)  # fmt: skip
        names = list(steps)
        for name in names:  # warm up: receive buffers, optimizer state
            steps[name]()
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                dist.barrier()
                started = time.perf_counter()
                steps[name]()
                dist.barrier()
                times[name].append((time.perf_counter() - started) * 1e3)
        if rank == 0:
            Path(out, "times.json").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def _train_step(schedule: Any, optimizer: torch.optim.Optimizer, tokens: torch.Tensor | None,
                targets: torch.Tensor | None) -> None:  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    args = (tokens,) if tokens is not None else ()
    schedule.step(*args, target=targets, return_outputs=False)
    optimizer.step()


def time_pipelines(
    config: PipelineConfig, wrappers: dict[str, StageWrapper | None], *, rounds: int
) -> dict[str, list[float]]:
    """Step times (ms, barrier to barrier, so the slowest rank's) of every variant of `config`'s
    pipeline, in one gloo group, in `rounds` rounds of one step each in a rotating order: variants
    timed under the same load, paired by round (the CPU's speed drifts over seconds)."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _time_main,
            args=(config, wrappers, rounds, free_port(), out),
            nprocs=config.processes,
            start_method="spawn",
        )
        return dict(json.loads(Path(out, "times.json").read_text()))


def reference_step(config: PipelineConfig) -> list[RankRecord]:
    """The unplanned pipeline's first step computed in this process: each micro-batch through every
    stage in turn, gradients accumulated in micro-batch order and divided by their number (the
    schedule's `scale_grads`); one record per stage with its loss and gradients (no peak)."""
    stages = build_stages(config)
    tokens, targets = example_batch(config)
    losses = []
    for index in range(config.micro_batches):
        rows = slice(index * config.micro_batch, (index + 1) * config.micro_batch)
        x = tokens[rows]
        for module in stages:
            x = module(x)
        loss = token_loss(x, targets[rows])
        loss.backward()
        losses.append(loss.detach())
    for module in stages:
        for parameter in module.parameters():
            assert parameter.grad is not None
            parameter.grad.div_(config.micro_batches)
    records = []
    for rank in range(config.processes):
        local = config.local_stages(rank)
        records.append(
            RankRecord(
                rank=rank,
                peak_bytes=0,
                start_bytes=0,
                loss=float(torch.stack(losses).mean()) if config.stages - 1 in local else None,
                gradients={
                    f"{stage}.{name}": p.grad.flatten().tolist()
                    for stage in local
                    for name, p in stages[stage].named_parameters()
                    if p.grad is not None
                },
            )
        )
    return records


def gradient_difference(a: RankRecord, b: RankRecord) -> float:
    """Largest absolute difference between two records' gradients (inf where the names differ)."""
    if a.gradients.keys() != b.gradients.keys():
        return math.inf
    return max(
        (
            abs(x - y)
            for name in a.gradients
            for x, y in zip(a.gradients[name], b.gradients[name], strict=True)
        ),
        default=0.0,
    )
