"""Models the compiled planner was not built around, for checking its predictions against inductor.

Why it exists: every figure `optimize(..., compile=True)` predicts comes from a model of what inductor
does (fusion, buffer reuse, kernel scratch, the partition's order), and each rule of that model was
found on some model of the zoos. These three were written afterwards, the way users write them, to
catch what the rules miss: a Hugging Face GPT-2 with dropout, a ViT built from `nn.TransformerEncoder`
(pre-norm, ReLU, dropout in attention and around the feed-forward) and a CNN with BatchNorm and
`nn.Dropout2d`. tests/planner/test_compiled_out_of_zoo.py plans them small; bench/compiled_check.py
plans them at the sizes below, with and without `torch._inductor.config.fallback_random`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from planner.testing.zoo_real import ExampleCall

__all__ = ["COMPILED_CHECK_MODELS", "SEED", "ConvDropoutNet", "EncoderViT", "build_gpt2_dropout"]

SEED = 0
"""Weights and inputs are drawn under this seed."""


def build_gpt2_dropout(layers: int = 4, width: int = 128, sequence: int = 128, batch: int = 4) -> ExampleCall:
    """Hugging Face's GPT-2 language model with dropout 0.1 everywhere, returning (loss, logits)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=1024, n_positions=sequence, use_cache=False,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    token_ids = torch.randint(config.vocab_size, (batch, sequence))
    return ExampleCall(GPT2LMHeadModel(config).train(), kwargs={"input_ids": token_ids, "labels": token_ids})


class EncoderViT(nn.Module):
    """A ViT as tutorials write it: patches by a strided convolution, `nn.TransformerEncoder`, mean pool."""

    def __init__(self, width: int = 128, layers: int = 4, patch: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, patch)
        layer = nn.TransformerEncoderLayer(
            width, 4, 4 * width, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(images).flatten(2).transpose(1, 2)
        return self.head(self.encoder(tokens).mean(dim=1))


class ConvDropoutNet(nn.Module):
    """Convolution, BatchNorm, ReLU and `nn.Dropout2d` blocks, then a pooled linear classifier."""

    def __init__(self, channels: int = 32, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = 3
        for _ in range(blocks):
            layers += [nn.Conv2d(width, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
            layers.append(nn.Dropout2d(0.1))
            width = channels
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(dim=(2, 3)))


def _vit(width: int = 128, layers: int = 4, batch: int = 8) -> ExampleCall:
    torch.manual_seed(SEED)
    model = EncoderViT(width, layers).train()
    return ExampleCall(model, (torch.randn(batch, 3, 64, 64),))


def _cnn(channels: int = 32, blocks: int = 4, batch: int = 16) -> ExampleCall:
    torch.manual_seed(SEED)
    model = ConvDropoutNet(channels, blocks).train()
    return ExampleCall(model, (torch.randn(batch, 3, 32, 32),))


COMPILED_CHECK_MODELS: dict[str, Callable[..., ExampleCall]] = {
    "gpt2_dropout": build_gpt2_dropout,
    "encoder_vit": _vit,
    "conv_dropout2d": _cnn,
}
"""Name -> builder; each builder's keyword arguments shrink the model (the tests pass smaller sizes)."""
