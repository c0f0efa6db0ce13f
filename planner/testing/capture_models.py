"""Small models for the Python features that trip capture, for planner/testing/zoo_real.py.

Why it exists: the real zoo holds, beside the libraries' models, hand-written ones that each carry one
feature a capture path must keep: dataclass, dict and tuple outputs with keyword-only inputs
(`KeywordTagger`), in-place operations (`InPlaceMLP`), a tied embedding and head (`TiedLanguageModel`),
forward hooks and pre-hooks (`HookedMLP`), and control flow on a tensor's value in the root forward
(`BranchingRoot`). They live here, as the CNNs live in vision_models.py, so the zoo reads as a list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BranchingRoot",
    "HookedMLP",
    "InPlaceMLP",
    "KeywordTagger",
    "ResidualBlock",
    "TaggerOutput",
    "TiedLanguageModel",
]


@dataclass
class TaggerOutput:
    """A Hugging Face-style output record: logits and every block's hidden state."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


class KeywordTagger(nn.Module):
    """Token tagger called with keyword-only inputs; returns a dataclass, a dict or a tuple."""

    def __init__(self, vocabulary: int = 512, width: int = 128, depth: int = 3, tags: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )
            for _ in range(depth)
        )
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(width, tags)

    def forward(
        self,
        token_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        output: str = "dataclass",
    ) -> TaggerOutput | dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
        x = self.embedding(token_ids)
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1)
        hidden_states = []
        for block in self.blocks:
            x = x + self.dropout(block(x))
            hidden_states.append(x)
        logits = self.head(x)
        if output == "dict":
            return {"logits": logits, "last_hidden_state": x}
        if output == "tuple":
            return (logits, x)
        return TaggerOutput(logits=logits, hidden_states=tuple(hidden_states))


class InPlaceMLP(nn.Module):
    """Residual MLP written with in-place ops: `mul_`/`add_`, `relu(inplace=True)`, slice assignment."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(depth))
        self.down = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(depth))
        self.shift = nn.Parameter(torch.zeros(2 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down, strict=True):
            hidden = up(x)
            hidden.mul_(0.5).add_(self.shift)
            hidden = F.relu(hidden, inplace=True)
            update = down(hidden)
            half = update.shape[-1] // 2
            update[:, :half] = update[:, :half].tanh()
            x = x + update
        return x


class TiedLanguageModel(nn.Module):
    """A small language model whose output projection is its token embedding (one Parameter)."""

    def __init__(self, vocabulary: int = 1024, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1)
                )
                for _ in range(depth)
            )
        )
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocabulary, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.blocks(self.embedding(token_ids))))


class ResidualBlock(nn.Module):
    """x + MLP(LayerNorm(x))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class HookedMLP(nn.Module):
    """Residual blocks with the hooks people register: a counting forward hook (its count is the
    buffer `blocks.1.forward_calls`), an output-halving forward hook and an input-doubling forward
    pre-hook. Each must run once per call, as without checkpointing.
    """

    def __init__(self, width: int = 128, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, width)
        self.blocks[1].register_buffer("forward_calls", torch.zeros((), dtype=torch.long))
        self.blocks[1].register_forward_hook(_count_call)
        self.blocks[3].register_forward_hook(_halve_output)
        self.blocks[4].register_forward_pre_hook(_double_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _count_call(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
    with torch.no_grad():
        module.get_buffer("forward_calls").add_(1)


def _halve_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 0.5


def _double_input(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(2.0 * tensor for tensor in inputs)


class BranchingRoot(nn.Module):
    """Runs its blocks forwards or backwards by the sign of the input's mean, in the root forward:
    control flow on a tensor's value, which neither torch.fx nor torch.export can follow."""

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = list(self.blocks) if x.mean() > 0 else list(reversed(self.blocks))
        for block in order:
            x = block(x)
        return x
