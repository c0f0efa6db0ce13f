"""A zoo of small, deterministic models for the demo, the tests and the benchmarks.

Why it exists: the planner should be judged on the models real users struggled with, not on chains chosen
because they are easy. So the zoo rebuilds the models of five reports from users whose checkpointing
went wrong, named `seed000` to `seed003` after them: a deep sigmoid MLP whose peak rose as more segments
were checkpointed (000); two CNNs, one the user checkpointed by hand operation by operation, and the
plain one (001); a CIFAR-10 model whose first block froze under reentrant checkpointing (002); a
FeedForward stack whose memory did not drop (003); plus a GPT-like transformer and a BatchNorm/dropout
CNN that bring attention, random ops and running statistics, and one MLP that `torch.fx.symbolic_trace`
cannot trace, for the capture fallback. Weights are random; nothing is downloaded.

Each entry is scaled so that one forward and backward step on a 2-core CPU takes under 0.15 s while the
saved activations are still megabytes, so checkpointing has something to save. `build()` constructs under
a fixed seed inside `torch.random.fork_rng`, so two builds give equal parameters and inputs and the
caller's global RNG stream is untouched. Models come back in train mode: dropout and BatchNorm behave as
they do in training.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "FIDELITY_ZOO",
    "ZOO",
    "CIFAR10Model",
    "CausalSelfAttention",
    "FeedForward",
    "GPTConfig",
    "ModelAndInputs",
    "Seed001CNN",
    "Seed001CheckpointedCNN",
    "SignGatedLinear",
    "TinyGPT",
    "TransformerBlock",
    "ZooModel",
    "build_model",
]

ModelAndInputs = tuple[nn.Module, tuple[torch.Tensor, ...]]

SEED = 0
"""Seed of every build; fixed so that two builds of one entry are equal tensor for tensor."""


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: `build()` returns a fresh model in train mode and its example inputs.

    An entry with `sizes` also builds at other sizes: `build(batch=64)`, `build(sequence=256)` (the
    description gives the defaults); `planner capacity zoo:NAME --batch 1..512` searches them.
    """

    name: str
    description: str
    build: Callable[..., ModelAndInputs]
    sizes: tuple[str, ...] = ()
    """The size keywords `build` takes: "batch" and/or "sequence"."""


def _seeded(construct: Callable[..., ModelAndInputs]) -> Callable[..., ModelAndInputs]:
    """Wrap a constructor so it runs under `SEED` without consuming the caller's RNG stream."""

    @functools.wraps(construct)
    def build(**sizes: int) -> ModelAndInputs:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model, inputs = construct(**sizes)
        return model.train(), inputs

    return build


def _build_seed000_mlp(batch: int = 1024) -> ModelAndInputs:
    width, layer_count = 256, 12
    layers: list[nn.Module] = []
    for _ in range(layer_count - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers += [nn.Linear(width, width), nn.Sigmoid()]
    return nn.Sequential(*layers), (torch.randn(batch, width),)


SEED001_HEIGHT, SEED001_WIDTH, SEED001_CHANNELS = 19, 22, 20
SEED001_OUT_FEATURES = 3258
"""The thread's output size, kept: its 52 MiB Linear weight dwarfs the activations, the thread's lesson."""


class Seed001CNN(nn.Module):
    """Seed 001's CNN without checkpointing: three 3x3 convolutions, then a large Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(SEED001_CHANNELS, 50, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(50, 25, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(25, 10, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(SEED001_HEIGHT * SEED001_WIDTH * 10, SEED001_OUT_FEATURES)

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.fc1(self.flat(x))


class Seed001CheckpointedCNN(Seed001CNN):
    """Seed 001's CNN as the user wrote it: every op after conv1 checkpointed on its own.

    One op per `checkpoint` call saves nothing (each call keeps its input, which is the previous op's
    saved tensor anyway), which is what the thread observed. Only `use_reentrant=False` is added: current
    PyTorch warns without an explicit choice, and the non-reentrant variant is the one the planner emits.
    `torch.fx.symbolic_trace` traces through these calls, so the captured graph is the plain CNN's.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = checkpoint(self.conv2, x, use_reentrant=False)
        x = checkpoint(F.relu, x, use_reentrant=False)
        x = checkpoint(self.conv3, x, use_reentrant=False)
        x = checkpoint(F.relu, x, use_reentrant=False)
        x = checkpoint(self.flat, x, use_reentrant=False)
        return checkpoint(self.fc1, x, use_reentrant=False)


def _seed001_inputs() -> tuple[torch.Tensor, ...]:
    batch_size = 16
    return (torch.randn(batch_size, SEED001_CHANNELS, SEED001_HEIGHT, SEED001_WIDTH),)


def _build_seed001_cnn() -> ModelAndInputs:
    return Seed001CNN(), _seed001_inputs()


def _build_seed001_cnn_checkpointed() -> ModelAndInputs:
    return Seed001CheckpointedCNN(), _seed001_inputs()


def _convolution_pair(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(out_channels, out_channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2),
    )


class CIFAR10Model(nn.Module):
    """Seed 002's CIFAR10Model without its `checkpoint` call; its flatten lambda became `nn.Flatten`."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn_block_1 = _convolution_pair(3, 32)
        self.dropout_1 = nn.Dropout(0.25)
        self.cnn_block_2 = _convolution_pair(32, 64)
        self.dropout_2 = nn.Dropout(0.25)
        self.flatten = nn.Flatten()
        self.linearize = nn.Sequential(nn.Linear(64 * 8 * 8, 512), nn.ReLU())
        self.dropout_3 = nn.Dropout(0.5)
        self.out = nn.Linear(512, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.dropout_1(self.cnn_block_1(images))
        x = self.dropout_2(self.cnn_block_2(x))
        x = self.dropout_3(self.linearize(self.flatten(x)))
        return self.out(x)


def _build_seed002_cifar10(batch: int = 32) -> ModelAndInputs:
    return CIFAR10Model(), (torch.randn(batch, 3, 32, 32),)


class FeedForward(nn.Module):
    """Seed 003's FeedForward: `num_layers` pairs of up- and down-projection with no activation between."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(hidden_size, intermediate_size), nn.Linear(intermediate_size, hidden_size)
            )
            for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build_seed003_feedforward(batch: int = 16, sequence: int = 128) -> ModelAndInputs:
    hidden_size, intermediate_size, num_layers = 256, 1024, 8
    model = FeedForward(hidden_size, intermediate_size, num_layers)
    return model, (torch.randn(batch, sequence, hidden_size, requires_grad=True),)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of `TinyGPT`. Shapes come from here, never from tensors, so that fx can trace the model."""

    vocabulary_size: int = 512
    sequence_length: int = 64
    model_width: int = 128
    head_count: int = 4
    layer_count: int = 6
    dropout_probability: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from plain ops, so every intermediate is a graph node."""

    causal_mask: torch.Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_count = config.head_count
        self.head_width = config.model_width // config.head_count
        self.query = nn.Linear(config.model_width, config.model_width)
        self.key = nn.Linear(config.model_width, config.model_width)
        self.value = nn.Linear(config.model_width, config.model_width)
        self.attention_dropout = nn.Dropout(config.dropout_probability)
        self.projection = nn.Linear(config.model_width, config.model_width)
        self.residual_dropout = nn.Dropout(config.dropout_probability)
        length = config.sequence_length
        # True where a query would see a later token. Not persistent: it follows from the config.
        future = torch.ones(length, length, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("causal_mask", future.view(1, 1, length, length), persistent=False)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, sequence, width) -> (batch, heads, sequence, head width)."""
        return x.unflatten(-1, (self.head_count, self.head_width)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = self.split_heads(self.query(x))
        key = self.split_heads(self.key(x))
        value = self.split_heads(self.value(x))
        scores = query @ key.transpose(-2, -1) * (1.0 / math.sqrt(self.head_width))
        scores = scores.masked_fill(self.causal_mask, float("-inf"))
        weights = self.attention_dropout(F.softmax(scores, dim=-1))
        heads = (weights @ value).transpose(1, 2).flatten(2)
        return self.residual_dropout(self.projection(heads))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width = config.model_width
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Linear(4 * width, width),
            nn.Dropout(config.dropout_probability),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """GPT-like decoder: token and learned position embeddings, pre-LN blocks, final norm, LM head.

    Takes token ids of shape (batch, `config.sequence_length`) and returns logits over the vocabulary.
    """

    positions: torch.Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocabulary_size, config.model_width)
        self.position_embedding = nn.Embedding(config.sequence_length, config.model_width)
        self.register_buffer("positions", torch.arange(config.sequence_length), persistent=False)
        self.blocks = nn.Sequential(*(TransformerBlock(config) for _ in range(config.layer_count)))
        self.final_norm = nn.LayerNorm(config.model_width)
        self.lm_head = nn.Linear(config.model_width, config.vocabulary_size, bias=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(token_ids) + self.position_embedding(self.positions)
        return self.lm_head(self.final_norm(self.blocks(x)))


def _build_gpt_tiny(batch: int = 8, sequence: int = 64) -> ModelAndInputs:
    config = GPTConfig(sequence_length=sequence)
    token_ids = torch.randint(config.vocabulary_size, (batch, config.sequence_length))
    return TinyGPT(config), (token_ids,)


def _convolution_block(in_channels: int, out_channels: int, *, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    ]
    if pool:
        layers += [nn.MaxPool2d(kernel_size=2), nn.Dropout2d(0.1)]
    return nn.Sequential(*layers)


def _build_cnn_bn_dropout(batch: int = 16) -> ModelAndInputs:
    model = nn.Sequential(
        _convolution_block(3, 32, pool=False),
        _convolution_block(32, 32, pool=True),
        _convolution_block(32, 64, pool=False),
        _convolution_block(64, 64, pool=True),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 256),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(256, 10),
    )
    return model, (torch.randn(batch, 3, 32, 32),)


class SignGatedLinear(nn.Module):
    """A Linear whose activation depends on the sign of the batch mean: fx cannot trace the branch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return self.linear(x).relu()
        return self.linear(x).tanh()


def _build_untraceable_mlp() -> ModelAndInputs:
    width, batch_size = 256, 512
    model = nn.Sequential(
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        SignGatedLinear(width),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
    )
    return model, (torch.randn(batch_size, width),)


ZOO: dict[str, ZooModel] = {
    entry.name: entry
    for entry in (
        ZooModel(
            "seed000_mlp",
            "Seed 000's deep MLP: 12 Linear layers of width 256 with ReLU, ending in Sigmoid; batch 1024 "
            "(the thread gives no sizes).",
            _seeded(_build_seed000_mlp),
            sizes=("batch",),
        ),
        ZooModel(
            "seed001_cnn",
            "Seed 001's CNN without checkpointing: conv 20->50->25->10 (3x3, pad 1, ReLU) on 19x22, "
            "flatten, Linear 4180->3258 (52 MiB of weight); batch 16 instead of the thread's 100.",
            _seeded(_build_seed001_cnn),
        ),
        ZooModel(
            "seed001_cnn_checkpointed",
            "Seed 001's CNN as the user wrote it, each op after conv1 in its own "
            "checkpoint(use_reentrant=False); batch 16.",
            _seeded(_build_seed001_cnn_checkpointed),
        ),
        ZooModel(
            "seed002_cifar10",
            "Seed 002's CIFAR10Model: two conv pairs with MaxPool, dropout 0.25/0.25/0.5, "
            "Linear 4096->512->10, without the post's checkpoint call; batch 32 of 3x32x32.",
            _seeded(_build_seed002_cifar10),
            sizes=("batch",),
        ),
        ZooModel(
            "seed003_feedforward",
            "Seed 003's FeedForward scaled to CPU: 8 x (Linear 256->1024, Linear 1024->256), "
            "input (16, 128, 256) with requires_grad=True (the thread: 1024/4096, input (128, 1024, 1024)).",
            _seeded(_build_seed003_feedforward),
            sizes=("batch", "sequence"),
        ),
        ZooModel(
            "gpt_tiny",
            "GPT-like decoder from plain ops: 6 pre-LN blocks, width 128, 4 heads, causal mask buffer, "
            "dropout 0.1, vocabulary 512; token ids (8, 64).",
            _seeded(_build_gpt_tiny),
            sizes=("batch", "sequence"),
        ),
        ZooModel(
            "cnn_bn_dropout",
            "Four Conv-BatchNorm2d-ReLU blocks (3->32->32->64->64, MaxPool and Dropout2d after the 2nd and "
            "4th), Linear 4096->256, Dropout 0.5, Linear 256->10; batch 16 of 3x32x32.",
            _seeded(_build_cnn_bn_dropout),
            sizes=("batch",),
        ),
        ZooModel(
            "untraceable_mlp",
            "MLP of width 256 whose SignGatedLinear branches on the sign of its input's mean, so "
            "symbolic_trace fails on the whole model but not on the root with that module as a leaf.",
            _seeded(_build_untraceable_mlp),
        ),
    )
}

CONTAINS_CHECKPOINT_CALLS = frozenset({"seed001_cnn_checkpointed"})
"""Entries that already call `torch.utils.checkpoint`; comparing a plan against them proves nothing."""

FIDELITY_ZOO: tuple[str, ...] = tuple(name for name in ZOO if name not in CONTAINS_CHECKPOINT_CALLS)
"""Entries whose planned gradients must equal the original model's in the fidelity tests."""


def build_model(name: str, **sizes: int) -> ModelAndInputs:
    """Build the zoo entry `name`: a fresh model in train mode and its example inputs, at the entry's
    default sizes or at `sizes` (`batch=`, `sequence=`) where the entry takes them."""
    try:
        entry = ZOO[name]
    except KeyError as error:
        raise KeyError(f"no zoo model named {name!r}; valid names: {', '.join(ZOO)}") from error
    unknown = sorted(set(sizes) - set(entry.sizes))
    if unknown:
        sized = [f"{other.name} ({', '.join(other.sizes)})" for other in ZOO.values() if other.sizes]
        raise ValueError(
            f"zoo model {name!r} does not take {', '.join(unknown)} (it takes "
            f"{list(entry.sizes) or 'no sizes'}); entries with sizes: {', '.join(sized)}"
        )
    return entry.build(**sizes)
