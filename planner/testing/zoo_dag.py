"""DAG-shaped models for the zoo, and the hand method they are judged against.

Why it exists: a planner whose plan space were intervals between single-tensor cuts would say
"impossible" exactly where checkpointing is used most: U-Nets (diffusion), DenseNets, encoder-decoders,
mixture-of-experts models and models holding `torch.nn` containers. These models are our own versions of
those shapes, small enough for a CPU test step, with activations of megabytes:

- `EfficientDenseNet`: the memory-efficient DenseNet users build (`checkpoint(bn_function,
  *prev_features)`), whose layers take the feature list as separate arguments;
- `DeepUNet`: depth 4, skip connections held in a Python list;
- `DiffusionUNet`: a timestep embedding added in every residual block, GroupNorm, self-attention at the
  lowest resolution, skips in a list; called with (images, timesteps);
- `ViTWithEncoder`: a ViT holding an `nn.TransformerEncoder` (norm_first, batch_first) as a child;
- `MoETransformer`: top-2 mixture-of-experts blocks with data-dependent routing that neither torch.fx
  nor torch.export can trace;
- `InlineMoETransformer` (`inline_moe_call`): the same routing written in the block's own `forward`,
  beside `nn.MultiheadAttention`, so that every block is one opaque node (issue 35). It is not among
  `dag_calls` (every test of the real zoo would run it); tests/planner/test_every_instance.py checks
  every hand method on it as on the zoos' models.

The hand methods they are judged against (`checkpoint_wrapper` on every instance of a repeated module
type, and the others users write) are in planner/testing/hand_methods.py. The planner's lowest peak
must never be above what any of them measures.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DeepUNet",
    "DiffusionUNet",
    "EfficientDenseNet",
    "InlineMoETransformer",
    "MoETransformer",
    "ViTWithEncoder",
    "dag_calls",
    "inline_moe_call",
]


class DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1 over the concatenated features (the `bn_function`), then BN-ReLU-Conv3x3-dropout."""

    def __init__(self, in_channels: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, 4 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)
        self.dropout = nn.Dropout(0.1)

    def bn_function(self, *features: torch.Tensor) -> torch.Tensor:
        return self.conv1(F.relu(self.norm1(torch.cat(features, 1))))

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.conv2(F.relu(self.norm2(self.bn_function(*features)))))


class DenseBlock(nn.Module):
    def __init__(self, in_channels: int, growth: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(in_channels + i * growth, growth) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(*features))
        return torch.cat(features, 1)


class EfficientDenseNet(nn.Module):
    """Two dense blocks of four layers (growth 12) and a pooling transition between them."""

    def __init__(self, growth: int = 12, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        channels = 2 * growth
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.block1 = DenseBlock(channels, growth, layers)
        channels += layers * growth
        self.transition = nn.Sequential(
            nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels // 2, 1), nn.AvgPool2d(2)
        )
        channels //= 2
        self.block2 = DenseBlock(channels, growth, layers)
        self.head = nn.Linear(channels + layers * growth, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.transition(self.block1(self.stem(images))))
        return self.head(x.mean((2, 3)))


class DoubleConvolution(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.norm(self.conv1(x))))


class DeepUNet(nn.Module):
    """Depth 4: each level's input is pushed on a list and popped by its mirror in the decoder."""

    def __init__(self, width: int = 8, depth: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.downs = nn.ModuleList(DoubleConvolution(width << i, width << (i + 1)) for i in range(depth))
        self.ups = nn.ModuleList(
            nn.ConvTranspose2d(width << (i + 1), width << i, 2, stride=2) for i in reversed(range(depth))
        )
        self.decoders = nn.ModuleList(
            DoubleConvolution(2 * (width << i), width << i) for i in reversed(range(depth))
        )
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        skips = []
        for down in self.downs:
            skips.append(x)
            x = down(F.max_pool2d(x, 2))
        for up, decoder in zip(self.ups, self.decoders, strict=True):
            x = decoder(torch.cat([up(x), skips.pop()], 1))
        return self.head(x)


def timestep_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of diffusion timesteps, as DDPM's."""
    half = dim // 2
    frequencies = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = timesteps.float()[:, None] * frequencies[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


class ResidualBlock(nn.Module):
    """GroupNorm-SiLU-conv, plus the projected timestep embedding, GroupNorm-SiLU-dropout-conv, + skip."""

    def __init__(self, in_channels: int, out_channels: int, embedding: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time = nn.Linear(embedding, out_channels)
        self.norm2 = nn.GroupNorm(4, out_channels)
        self.dropout = nn.Dropout(0.1)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.skip = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.time(F.silu(embedding))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return h + self.skip(x)


class SelfAttention(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.projection = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(batch, 3, channels, height * width).unbind(1)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.projection(attended.transpose(1, 2).reshape(batch, channels, height, width))


class DiffusionUNet(nn.Module):
    """Three levels of residual blocks with the timestep embedding, attention at the lowest level."""

    def __init__(self, width: int = 16, levels: int = 3, embedding: int = 64) -> None:
        super().__init__()
        self.embedding = embedding
        self.time_mlp = nn.Sequential(
            nn.Linear(embedding, embedding), nn.SiLU(), nn.Linear(embedding, embedding)
        )
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        channels = [width << level for level in range(levels)]
        self.encoder = nn.ModuleList(
            ResidualBlock(channels[max(0, i - 1)], channels[i], embedding) for i in range(levels)
        )
        self.middle = ResidualBlock(channels[-1], channels[-1], embedding)
        self.attention = SelfAttention(channels[-1])
        self.decoder = nn.ModuleList(
            ResidualBlock(2 * channels[i], channels[max(0, i - 1)], embedding)
            for i in reversed(range(levels))
        )
        self.head = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, images: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        embedding = self.time_mlp(timestep_embedding(timesteps, self.embedding))
        x = self.stem(images)
        skips = []
        for level, block in enumerate(self.encoder):
            x = block(x if level == 0 else F.avg_pool2d(x, 2), embedding)
            skips.append(x)
        x = self.attention(self.middle(x, embedding))
        for level, block in enumerate(self.decoder):
            if level:
                x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = block(torch.cat([x, skips.pop()], 1), embedding)
        return self.head(x)


class ViTWithEncoder(nn.Module):
    """Patch embedding, learned positions, an `nn.TransformerEncoder` child and a classification head."""

    def __init__(self, width: int = 128, layers: int = 4, patches: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, 4, stride=4)
        self.positions = nn.Parameter(torch.zeros(1, patches, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2) + self.positions
        return self.head(self.encoder(x).mean(1))


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TopTwoMixture(nn.Module):
    """Each token goes to its two highest-scoring experts; experts with no token are skipped (data-
    dependent control flow, which neither torch.fx nor torch.export traces)."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.router(tokens), -1), 2, dim=-1)
        mixed = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slots = torch.where(chosen == index)
            if rows.numel() == 0:
                continue
            mixed = mixed.index_add(0, rows, expert(tokens[rows]) * weights[rows, slots, None])
        return mixed.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mixture = TopTwoMixture(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attention(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.projection(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mixture(self.norm2(x))


class MoETransformer(nn.Module):
    def __init__(self, vocabulary: int = 512, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(MoEBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocabulary)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(token_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class InlineMoEBlock(nn.Module):
    """Pre-norm block: `nn.MultiheadAttention`, then top-2 routing over four experts written in this
    `forward` (no child module holds it), so the capture keeps the whole block as one node."""

    def __init__(self, width: int, heads: int = 4, experts: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attended, _ = self.attention(h, h, h, need_weights=False)
        x = x + attended
        tokens = self.norm2(x).reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.router(tokens), -1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        mixed = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slots = (chosen == index).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            mixed.index_add_(0, rows, expert(tokens[rows]) * weights[rows, slots].unsqueeze(-1))
        return x + mixed.reshape(x.shape)


class InlineMoETransformer(nn.Module):
    def __init__(self, vocabulary: int = 512, width: int = 128, depth: int = 6, sequence: int = 64) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(1, sequence, width))
        self.blocks = nn.ModuleList(InlineMoEBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(token_ids) + self.position[:, : token_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def inline_moe_call() -> tuple[nn.Module, tuple[Any, ...]]:
    """`InlineMoETransformer` and its tokens (8, 64) (the caller seeds it)."""
    return InlineMoETransformer(), (torch.randint(512, (8, 64)),)


def dag_calls() -> dict[str, tuple[nn.Module, tuple[Any, ...]]]:
    """Builders' results by zoo name (the caller seeds them): each model and its positional inputs."""
    return {
        "densenet_efficient": (EfficientDenseNet(), (torch.randn(8, 3, 32, 32),)),
        "unet_deep": (DeepUNet(), (torch.randn(4, 3, 64, 64),)),
        "unet_diffusion": (DiffusionUNet(), (torch.randn(4, 3, 32, 32), torch.randint(1000, (4,)))),
        "vit_torch_encoder": (ViTWithEncoder(), (torch.randn(16, 3, 32, 32),)),
        "moe_transformer": (MoETransformer(), (torch.randint(512, (8, 64)),)),
    }
