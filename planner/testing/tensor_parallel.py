"""A Llama-style block stack and the Megatron tensor parallel plan torchtitan writes for it.

Why it exists: `optimize(..., tensor_parallel=mesh)` is checked on the model shape tensor parallelism
is used for, in real gloo process groups (tests/planner/test_tensor_parallel.py), and the zoo's
transformers cannot be split: `TinyGPT`'s attention reshapes by its full head count, and
`parallelize_module` hands each rank heads/k of them. `LlamaStack` is torchtitan's Llama written small:
RMSNorm before attention and the SwiGLU MLP, no biases, attention that reshapes by the head width
(`view(batch, sequence, -1, head_width)`) so it runs on any number of local heads, and an untied output
projection. `megatron_plan` is torchtitan's plan for a block without sequence parallelism: column-wise
q/k/v and gate/up projections, row-wise output projections (an all-reduce after each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

__all__ = ["LlamaConfig", "LlamaStack", "megatron_plan", "parallelize_megatron"]


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
