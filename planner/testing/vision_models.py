"""The convolutional networks of the real-model zoo, written as torchvision writes them: a ResNet of
basic blocks, a DenseNet of concatenating layers and a U-Net with skip connections, small enough for
the CPU.

Why it exists: planner/testing/zoo_real.py lists the zoo's entries (each model with its example call);
the architectures it builds without a library live here, so the registry stays one list and each
network one class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BasicBlock", "DenseLayer", "DenseNet", "ResNet", "UNet"]


def _convolution(in_channels: int, out_channels: int, *, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, an in-place residual addition."""

    def __init__(self, in_channels: int, out_channels: int, *, stride: int = 1) -> None:
        super().__init__()
        self.first = _convolution(in_channels, out_channels, stride=stride)
        self.relu = nn.ReLU(inplace=True)
        self.second = _convolution(out_channels, out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.second(self.relu(self.first(x)))
        out += self.shortcut(x)
        return self.relu(out)


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a stem, three stages of two basic blocks, global pooling, a classifier."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(_convolution(3, widths[0]), nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        in_channels = widths[0]
        for stage, width in enumerate(widths):
            blocks.append(BasicBlock(in_channels, width, stride=1 if stage == 0 else 2))
            blocks.append(BasicBlock(width, width))
            in_channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(in_channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(images))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(features, 1), 1))


class DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1-BN-ReLU-Conv3x3, its output concatenated to its input (DenseNet-BC)."""

    def __init__(self, in_channels: int, growth: int) -> None:
        super().__init__()
        self.bottleneck = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(),
            nn.Conv2d(in_channels, 4 * growth, 1, bias=False),
            nn.BatchNorm2d(4 * growth),
            nn.ReLU(),
            nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.bottleneck(x)], dim=1)


class DenseNet(nn.Module):
    """Two dense blocks of four layers (growth 12) with a pooling transition between them."""

    def __init__(self, growth: int = 12, layers_per_block: int = 4, classes: int = 10) -> None:
        super().__init__()
        channels = 2 * growth
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        features: list[nn.Module] = []
        for block in range(2):
            for _ in range(layers_per_block):
                features.append(DenseLayer(channels, growth))
                channels += growth
            if block == 0:
                features += [
                    nn.BatchNorm2d(channels),
                    nn.ReLU(),
                    nn.Conv2d(channels, channels // 2, 1, bias=False),
                    nn.AvgPool2d(2),
                ]
                channels //= 2
        self.features = nn.Sequential(*features, nn.BatchNorm2d(channels), nn.ReLU())
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.features(self.stem(images))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(features, 1), 1))


def _double_convolution(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A two-level U-Net: the encoder's features are concatenated into the decoder across the U."""

    def __init__(self, width: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.encoder1 = _double_convolution(3, width)
        self.encoder2 = _double_convolution(width, 2 * width)
        self.bottleneck = _double_convolution(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.decoder2 = _double_convolution(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.decoder1 = _double_convolution(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        skip1 = self.encoder1(images)
        skip2 = self.encoder2(F.max_pool2d(skip1, 2))
        x = self.bottleneck(F.max_pool2d(skip2, 2))
        x = self.decoder2(torch.cat([self.up2(x), skip2], dim=1))
        x = self.decoder1(torch.cat([self.up1(x), skip1], dim=1))
        return self.head(x)
