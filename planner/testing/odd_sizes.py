"""A model of odd sizes, where CUDA's 512-byte rounding matters: for tests and benches of the counting.

Why it exists: a convolution net with GroupNorm whose activations are never a multiple of 512 bytes and
whose GroupNorm statistics are 48 bytes each, like the diffusion U-Net that measured 0.7 % over a budget
counted in exact bytes. No zoo was built around it; tests/planner/test_device_memory.py and
bench/device_memory.py plan it in both countings (NOTE [counted bytes] in planner/ir.py).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OddBlock", "OddGroupNormNet", "odd_net"]


class OddBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(4, channels)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.norm(self.conv(x)))


class OddGroupNormNet(nn.Module):
    """Twelve channels on 13 x 13 images: no activation is a multiple of 512 bytes."""

    def __init__(self, channels: int = 12, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(OddBlock(channels) for _ in range(depth)))
        self.head = nn.Linear(channels * 13 * 13, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).flatten(1))


def odd_net() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (seeded) and a batch of 3 images."""
    torch.manual_seed(0)
    return OddGroupNormNet(), (torch.randn(3, 3, 13, 13),)
