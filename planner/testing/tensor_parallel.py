"""A Llama-style block stack and the Megatron tensor parallel plan torchtitan writes for it.

Why it exists: `optimize(..., tensor_parallel=mesh)` is checked on the model shape tensor parallelism
is used for, in real gloo process groups (tests/planner/test_tensor_parallel.py), and the zoo's
transformers cannot be split: `TinyGPT`'s attention reshapes by its full head count, and
`parallelize_module` hands each rank heads/k of them. `LlamaStack` is torchtitan's Llama written small:
RMSNorm before attention and the SwiGLU MLP, no biases, attention that reshapes by the head width
(`view(batch, sequence, -1, head_width)`) so it runs on any number of local heads, and an untied output
projection. `megatron_plan` is torchtitan's plan for a block without sequence parallelism: column-wise
q/k/v and gate/up projections, row-wise output projections (an all-reduce after each).
`tensor_parallel_rank_step` is one rank's whole check, run in a gloo group by
`planner.testing.ranks.run_ranks` for the test and for bench/tensor_parallel.py alike.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

import planner
from planner.ir import MemoryCounting, TrainingStep
from planner.profiler.measurement import _allocator_peaks, _train_step, make_optimizer
from planner.testing.hand_methods import checkpoint_every_instance

__all__ = [
    "LlamaConfig",
    "LlamaStack",
    "megatron_plan",
    "next_token_loss",
    "parallelize_megatron",
    "tensor_parallel_rank_step",
]

SEED = 1234
BATCH, SEQUENCE = 4, 64
"""The example batch every rank plans and trains on (tensor parallelism splits the model, not the batch)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of `LlamaStack`; `head_count` and `hidden_width` must divide by the tensor parallel degree."""

    vocabulary_size: int = 256
    model_width: int = 128
    head_count: int = 4
    hidden_width: int = 352
    layer_count: int = 4


class Attention(nn.Module):
    """Causal self-attention whose head count follows from its projections' width (the local heads)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        width = config.model_width
        self.head_width = width // config.head_count
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, sequence, heads * head width) -> (batch, heads, sequence, head width)."""
        return x.unflatten(-1, (-1, self.head_width)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key, value = (self.split_heads(project(x)) for project in (self.wq, self.wk, self.wv))
        heads = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.wo(heads.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.model_width, config.hidden_width, bias=False)
        self.w2 = nn.Linear(config.hidden_width, config.model_width, bias=False)
        self.w3 = nn.Linear(config.model_width, config.hidden_width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.model_width)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.model_width)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaStack(nn.Module):
    """Token embedding, `layer_count` blocks, final norm and output projection: logits over the vocabulary."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocabulary_size, config.model_width)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layer_count))
        self.norm = nn.RMSNorm(config.model_width)
        self.output = nn.Linear(config.model_width, config.vocabulary_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def megatron_plan() -> dict[str, ParallelStyle]:
    """torchtitan's per-block tensor parallel plan without sequence parallelism."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }


def parallelize_megatron(model: LlamaStack, mesh: DeviceMesh, *, ends: bool = False) -> LlamaStack:
    """`model` with every block split over `mesh` by `megatron_plan` (in place, as torchtitan does);
    with `ends`, also the embedding row-wise and the output projection column-wise, both handing on
    replicated plain tensors (torchtitan's top-level plan without sequence and loss parallelism)."""
    for block in model.layers:
        parallelize_module(block, mesh, megatron_plan())
    if ends:
        ends_plan: dict[str, ParallelStyle] = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(model, mesh, ends_plan)
    return model


def next_token_loss(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the plain logits every rank holds."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _local_gradients(module: nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss of one forward and backward, and each parameter's local gradient (then cleared)."""
    module.zero_grad(set_to_none=True)
    loss = next_token_loss(tokens, module(tokens))
    loss.backward()
    gradients = {}
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None, name
        gradient = parameter.grad
        gradients[name] = gradient.to_local() if isinstance(gradient, DTensor) else gradient
    module.zero_grad(set_to_none=True)
    return loss.item(), gradients


def _shard_bytes(model: nn.Module) -> int:
    """The bytes of this rank's shards of the parameters (a DTensor's `to_local()`), in 512-byte blocks."""
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(MemoryCounting.BLOCKS.of(shard.untyped_storage().nbytes()) for shard in shards)


def _allocator_peak_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """The step's peak counted from the CPU allocator's own events (which also see gloo's buffers)."""
    optimizer = make_optimizer("adam", list(model.parameters()))
    loss_fn = functools.partial(next_token_loss, tokens)
    run = functools.partial(
        _train_step, model, (tokens,), {}, loss_fn, optimizer, step=TrainingStep(), scaler=None
    )
    peaks = _allocator_peaks(run, [*model.parameters()])
    peaks.phase_bytes.pop("start", None)
    return max(peaks.phase_bytes.values())


def tensor_parallel_rank_step(
    rank: int, world_size: int, fractions: tuple[float, ...], ends: bool = False, allocator: bool = False
) -> dict[str, Any]:
    """One rank of a gloo group of `world_size` (run by `run_ranks`): `LlamaStack` split by
    `parallelize_megatron` (with `ends`, the embedding and output too), planned with
    `tensor_parallel=mesh` at the lowest achievable peak plus each of `fractions` of the way to the
    unplanned peak. Reports, in 512-byte blocks measured inside the rank: the unplanned step (and, with
    `allocator`, the CPU allocator's count of it), the whole model unsplit, `checkpoint_wrapper` on every
    block, what a budget one below the lowest raises, and per plan its predicted and measured peak,
    regions, schedule and whether loss and gradients equal the unplanned run's bit for bit."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(SEED)
    base = LlamaStack(LlamaConfig())
    tokens = torch.randint(LlamaConfig().vocabulary_size, (BATCH, SEQUENCE))
    loss_fn = functools.partial(next_token_loss, tokens)
    unplanned = parallelize_megatron(copy.deepcopy(base), mesh, ends=ends)
    expected_loss, expected = _local_gradients(unplanned, tokens)
    model = parallelize_megatron(copy.deepcopy(base), mesh, ends=ends)
    profile = planner.profile(model, (tokens,), loss_fn=loss_fn, tensor_parallel=mesh)
    unplanned_bytes = planner.measure(copy.deepcopy(unplanned), (tokens,), loss_fn=loss_fn).peak_bytes
    every_block = checkpoint_every_instance(unplanned, Block)
    lowest = profile.plan(budget_bytes=2**40).min_peak_bytes
    try:
        profile.plan(budget_bytes=lowest - 1)
        too_low = "planned"
    except planner.InfeasibleBudget as error:  # on every rank, none left waiting in a collective
        too_low = f"InfeasibleBudget {error.min_peak_bytes}"
    plans = []
    for fraction in fractions:
        plan = profile.plan(budget_bytes=lowest + int(fraction * (unplanned_bytes - lowest)))
        assert plan.module is not None
        loss, gradients = _local_gradients(plan.module, tokens)
        measured = planner.measure(copy.deepcopy(plan.module), (tokens,), loss_fn=loss_fn)
        plans.append(
            {
                "budget_bytes": plan.budget_bytes,
                "predicted_bytes": plan.predicted_peak_bytes,
                "measured_bytes": measured.peak_bytes,
                "regions": len(plan.schedule.checkpointed),
                "schedule": repr(plan.schedule.regions),
                "loss_and_gradients_equal": loss == expected_loss
                and all(torch.equal(gradient, expected[name]) for name, gradient in gradients.items()),
            }
        )
    return {
        "rank": rank,
        "unplanned_bytes": unplanned_bytes,
        "unplanned_allocator_bytes": _allocator_peak_bytes(copy.deepcopy(unplanned), tokens)
        if allocator
        else None,
        "unsplit_bytes": planner.measure(copy.deepcopy(base), (tokens,), loss_fn=loss_fn).peak_bytes,
        "every_block_bytes": planner.measure(every_block, (tokens,), loss_fn=loss_fn).peak_bytes,
        "lowest_bytes": lowest,
        "too_low": too_low,
        "parameter_bytes": profile.graph.static.parameter_bytes,
        "shard_bytes": _shard_bytes(model),
        "capture": profile.graph.capture,
        "plans": plans,
    }
