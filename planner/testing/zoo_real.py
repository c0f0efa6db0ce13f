"""The models people train, at CI size: what the capture chain and the rewriter must handle unedited.

Why it exists: `planner.zoo` rebuilds the users' threads; this zoo holds the model families a
checkpoint planner meets in practice and that break other planners: Hugging Face `transformers`
models (GPT-2, BERT, Llama, T5, ViT) built from random-weight configs, PyTorch's own
`nn.TransformerEncoder`/`nn.TransformerDecoder` stacks, ResNet-, DenseNet- and U-Net-style CNNs
(BatchNorm, residual additions, concatenation), and small models for the Python features that trip
capture: dataclass outputs with keyword-only inputs, in-place operations, tied weights, and hooks. One
model branches on a tensor's value in its root `forward`, which neither torch.fx nor torch.export can
follow, so it is planned by its submodules (planner/capture/model_call.py).

Each entry says which capture path it is expected to take (`RealModel.capture`). `build()` runs under
a fixed seed without consuming the caller's RNG stream and returns the model in train mode with its
example call. Nothing is downloaded: Hugging Face models come from configs, and `transformers` is
imported inside their build functions only, so the library does not depend on it (install the `dev`
extra to build them).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from planner.testing.capture_models import (
    BranchingRoot,
    HookedMLP,
    InPlaceMLP,
    KeywordTagger,
    TaggerOutput,
    TiedLanguageModel,
)
from planner.testing.vision_models import DenseNet, ResNet, UNet
from planner.testing.zoo_dag import dag_calls

__all__ = [
    "LIBRARY_ZOO",
    "REAL_ZOO",
    "BranchingRoot",
    "DenseNet",
    "ExampleCall",
    "HookedMLP",
    "InPlaceMLP",
    "KeywordTagger",
    "RealModel",
    "ResNet",
    "TaggerOutput",
    "TiedLanguageModel",
    "UNet",
    "build_call",
    "seeded",
    "transformers_module",
]

SEED = 0
"""Seed of every build; two builds of one entry are equal tensor for tensor."""

DAG_DESCRIPTIONS = {
    "densenet_efficient": "Memory-efficient DenseNet: layers called as layer(*features) (cat, BN, ReLU, "
    "1x1 conv, BN, ReLU, 3x3 conv, dropout), 2 blocks of 4, growth 12; batch 8 of 3x32x32.",
    "unet_deep": "U-Net of depth 4, skips held in a list, BatchNorm; batch 4 of 3x64x64.",
    "unet_diffusion": "Diffusion U-Net: timestep embedding added in every residual block, GroupNorm, "
    "dropout, self-attention at the lowest level, skips in a list; (images 4x3x32x32, timesteps).",
    "vit_torch_encoder": "ViT holding nn.TransformerEncoder (4 layers, norm_first, batch_first, width "
    "128) as a child; batch 16 of 3x32x32.",
    "moe_transformer": "Transformer of 4 blocks with top-2 mixture-of-experts MLPs (4 experts, "
    "data-dependent routing that FX and export cannot trace); tokens (8, 64).",
}
"""The DAG-shaped entries of planner/testing/zoo_dag.py."""

HUGGING_FACE = "transformers"
"""The optional package the Hugging Face entries need."""
DIFFUSERS = "diffusers"
"""The optional package `LIBRARY_ZOO`'s diffusers entry needs."""


@dataclass(frozen=True)
class ExampleCall:
    """A model in train mode and the call one training step makes: `model(*args, **kwargs)`."""

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RealModel:
    """One entry: how to build it, the capture path it should take, and what it needs installed."""

    name: str
    description: str
    build: Callable[[], ExampleCall]
    capture: str
    """Expected `Plan.capture`: "fx", "export" or "module" (see planner/capture/chain.py and
    model_call.py)."""
    requires: str | None = None
    routes_by_value: bool = False
    """Its forward picks which tensors to compute by their values (top-k routing with nonzero), so its
    memory follows the routing, and an optimizer step moves the routing: the example's routing is what
    is profiled and planned, and the tests measure with it frozen (NOTE [routing by value] in
    tests/planner/real_models.py)."""


ROUTED_BY_VALUE = frozenset({"moe_transformer"})
"""The DAG-shaped entries whose forward routes by value."""


def seeded(construct: Callable[[], ExampleCall]) -> Callable[[], ExampleCall]:
    """Run `construct` under `SEED` without consuming the caller's RNG stream; train mode."""

    @functools.wraps(construct)
    def build() -> ExampleCall:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            call = construct()
        call.model.train()
        return call

    return build


def transformers_module() -> ModuleType:
    """`transformers`, or an ImportError that says how to install it."""
    try:
        return importlib.import_module(HUGGING_FACE)
    except ImportError as error:
        raise ImportError(
            "the Hugging Face zoo entries need `transformers`: pip install -e '.[dev]' (or pip install "
            "transformers)"
        ) from error


def _build_hf_gpt2() -> ExampleCall:
    hf = transformers_module()
    config = hf.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=512,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    token_ids = torch.randint(config.vocab_size, (4, 48))
    return ExampleCall(hf.GPT2LMHeadModel(config), kwargs={"input_ids": token_ids, "labels": token_ids})


def _build_hf_bert() -> ExampleCall:
    hf = transformers_module()
    config = hf.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=64,
        use_cache=False,
    )
    token_ids = torch.randint(config.vocab_size, (4, 48))
    attention_mask = torch.ones_like(token_ids)
    attention_mask[:, -8:] = 0
    return ExampleCall(
        hf.BertForMaskedLM(config),
        kwargs={"input_ids": token_ids, "attention_mask": attention_mask, "labels": token_ids},
    )


def _build_hf_llama() -> ExampleCall:
    hf = transformers_module()
    config = hf.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=192,
        vocab_size=512,
        max_position_embeddings=64,
        attention_dropout=0.1,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    token_ids = torch.randint(config.vocab_size, (4, 48))
    return ExampleCall(hf.LlamaForCausalLM(config), kwargs={"input_ids": token_ids, "labels": token_ids})


def _build_hf_t5() -> ExampleCall:
    hf = transformers_module()
    config = hf.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=64,
        d_kv=16,
        num_heads=4,
        d_ff=192,
        vocab_size=512,
        use_cache=False,
        decoder_start_token_id=0,
    )
    source = torch.randint(config.vocab_size, (4, 32))
    target = torch.randint(config.vocab_size, (4, 24))
    return ExampleCall(hf.T5ForConditionalGeneration(config), kwargs={"input_ids": source, "labels": target})


def _build_hf_t5_long_source() -> ExampleCall:
    """T5 whose encoder output (128 source tokens) is read by every decoder layer's cross-attention."""
    hf = transformers_module()
    config = hf.T5Config(
        num_layers=3,
        num_decoder_layers=3,
        d_model=64,
        d_kv=16,
        num_heads=4,
        d_ff=256,
        vocab_size=512,
        use_cache=False,
        decoder_start_token_id=0,
    )
    source = torch.randint(config.vocab_size, (4, 128))
    target = torch.randint(config.vocab_size, (4, 16))
    return ExampleCall(hf.T5ForConditionalGeneration(config), kwargs={"input_ids": source, "labels": target})


def _build_diffusers_unet() -> ExampleCall:
    try:
        diffusers = importlib.import_module(DIFFUSERS)
    except ImportError as error:
        raise ImportError("the diffusers entry needs `diffusers`: pip install -e '.[dev]'") from error
    model = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=8,
    )
    return ExampleCall(model, (torch.randn(4, 3, 16, 16), torch.randint(1000, (4,))))


def _build_hf_clip() -> ExampleCall:
    hf = transformers_module()
    text = {
        "vocab_size": 512,
        "max_position_embeddings": 32,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    }
    vision = {"image_size": 32, "patch_size": 8}
    shared = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    config = hf.CLIPConfig(text_config=text | shared, vision_config=vision | shared, projection_dim=32)
    kwargs = {
        "input_ids": torch.randint(512, (4, 32)),
        "pixel_values": torch.randn(4, 3, 32, 32),
        "return_loss": True,
    }
    return ExampleCall(hf.CLIPModel(config), kwargs=kwargs)


def _build_hf_albert() -> ExampleCall:
    hf = transformers_module()
    config = hf.AlbertConfig(
        vocab_size=512,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    token_ids = torch.randint(config.vocab_size, (4, 32))
    return ExampleCall(hf.AlbertForMaskedLM(config), kwargs={"input_ids": token_ids, "labels": token_ids})


def _dag_call(name: str) -> Callable[[], ExampleCall]:
    def build() -> ExampleCall:
        model, args = dag_calls()[name]
        return ExampleCall(model, args)

    return build


def _build_hf_vit() -> ExampleCall:
    hf = transformers_module()
    config = hf.ViTConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        image_size=32,
        patch_size=4,
        num_labels=10,
        hidden_dropout_prob=0.1,
    )
    images = torch.randn(4, 3, 32, 32)
    labels = torch.randint(config.num_labels, (4,))
    return ExampleCall(
        hf.ViTForImageClassification(config), kwargs={"pixel_values": images, "labels": labels}
    )


TRANSFORMER_WIDTH, TRANSFORMER_HEADS, TRANSFORMER_LAYERS = 64, 4, 2


def _transformer_layer_options() -> dict[str, Any]:
    return {
        "d_model": TRANSFORMER_WIDTH,
        "nhead": TRANSFORMER_HEADS,
        "dim_feedforward": 4 * TRANSFORMER_WIDTH,
        "dropout": 0.1,
        "batch_first": True,
    }


def _build_transformer_encoder() -> ExampleCall:
    layer = nn.TransformerEncoderLayer(**_transformer_layer_options())
    model = nn.TransformerEncoder(layer, TRANSFORMER_LAYERS, enable_nested_tensor=False)
    source = torch.randn(8, 32, TRANSFORMER_WIDTH)
    padding = torch.zeros(8, 32, dtype=torch.bool)
    padding[:, -6:] = True
    return ExampleCall(model, (source,), {"src_key_padding_mask": padding})


def _build_transformer_decoder() -> ExampleCall:
    layer = nn.TransformerDecoderLayer(**_transformer_layer_options())
    model = nn.TransformerDecoder(layer, TRANSFORMER_LAYERS)
    target = torch.randn(8, 24, TRANSFORMER_WIDTH)
    memory = torch.randn(8, 32, TRANSFORMER_WIDTH)
    causal = nn.Transformer.generate_square_subsequent_mask(24)
    return ExampleCall(model, (target, memory), {"tgt_mask": causal, "tgt_is_causal": True})


def _build_resnet() -> ExampleCall:
    return ExampleCall(ResNet(), (torch.randn(8, 3, 32, 32),))


def _build_densenet() -> ExampleCall:
    return ExampleCall(DenseNet(), (torch.randn(4, 3, 32, 32),))


def _build_unet() -> ExampleCall:
    return ExampleCall(UNet(), (torch.randn(4, 3, 32, 32),))


def _tagger_call(output: str) -> ExampleCall:
    token_ids = torch.randint(512, (8, 64))
    attention_mask = torch.ones(8, 64)
    attention_mask[:, -10:] = 0.0
    return ExampleCall(KeywordTagger(), (token_ids,), {"attention_mask": attention_mask, "output": output})


def _build_inplace_mlp() -> ExampleCall:
    return ExampleCall(InPlaceMLP(), (torch.randn(512, 256),))


def _build_tied_lm() -> ExampleCall:
    return ExampleCall(TiedLanguageModel(), (torch.randint(1024, (8, 64)),))


def _build_hooked_mlp() -> ExampleCall:
    model = HookedMLP()
    return ExampleCall(model, (torch.randn(256, 128),))


def _build_branching_root() -> ExampleCall:
    return ExampleCall(BranchingRoot(), (torch.randn(256, 128),))


REAL_ZOO: dict[str, RealModel] = {
    entry.name: entry
    for entry in (
        RealModel(
            "hf_gpt2",
            "Hugging Face GPT2LMHeadModel: 2 layers, width 64, 4 heads, vocabulary 512, dropout 0.1, tied LM "
            "head; input_ids and labels (4, 48), use_cache=False.",
            seeded(_build_hf_gpt2),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "hf_bert",
            "Hugging Face BertForMaskedLM: 2 layers, width 64, 4 heads, vocabulary 512; input_ids, "
            "attention_mask (last 8 tokens padded) and labels (4, 48).",
            seeded(_build_hf_bert),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "hf_llama",
            "Hugging Face LlamaForCausalLM: 2 layers, width 64, 4 heads with 2 KV heads (GQA), RoPE, "
            "RMSNorm, SwiGLU, attention dropout 0.1; input_ids and labels (4, 48).",
            seeded(_build_hf_llama),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "hf_t5",
            "Hugging Face T5ForConditionalGeneration: 2 encoder and 2 decoder layers, width 64, relative "
            "position bias; input_ids (4, 32), labels (4, 24).",
            seeded(_build_hf_t5),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "hf_vit",
            "Hugging Face ViTForImageClassification: 2 layers, width 64, patch 4 on 32x32 images, dropout "
            "0.1; pixel_values (4, 3, 32, 32) and labels.",
            seeded(_build_hf_vit),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "transformer_encoder",
            "nn.TransformerEncoder: 2 post-LN layers, width 64, 4 heads, dropout 0.1, batch_first; source "
            "(8, 32, 64) with src_key_padding_mask (last 6 positions).",
            seeded(_build_transformer_encoder),
            capture="export",
        ),
        RealModel(
            "transformer_decoder",
            "nn.TransformerDecoder: 2 layers, width 64, 4 heads, dropout 0.1; target (8, 24, 64) with a "
            "causal tgt_mask, memory (8, 32, 64).",
            seeded(_build_transformer_decoder),
            capture="export",
        ),
        RealModel(
            "resnet",
            "CIFAR-style ResNet: stem and 3 stages of 2 basic blocks (16/32/64 channels), BatchNorm, "
            "in-place ReLU and residual +=; batch 8 of 3x32x32.",
            seeded(_build_resnet),
            capture="fx",
        ),
        RealModel(
            "densenet",
            "DenseNet-BC: 2 dense blocks of 4 layers (growth 12, BN-ReLU-Conv1x1-BN-ReLU-Conv3x3, "
            "concatenation), a pooling transition; batch 4 of 3x32x32.",
            seeded(_build_densenet),
            capture="fx",
        ),
        RealModel(
            "unet",
            "Two-level U-Net: double 3x3 convolutions with BatchNorm, max pooling, transposed convolutions, "
            "skip concatenation; batch 4 of 3x32x32, 2 classes per pixel.",
            seeded(_build_unet),
            capture="fx",
        ),
        RealModel(
            "keyword_dataclass",
            "Token tagger called with a keyword-only attention_mask and output='dataclass', returning a "
            "dataclass of logits and a tuple of hidden states; 3 blocks, tokens (8, 64).",
            seeded(lambda: _tagger_call("dataclass")),
            capture="fx",
        ),
        RealModel(
            "keyword_dict",
            "The token tagger returning a dict (output='dict').",
            seeded(lambda: _tagger_call("dict")),
            capture="fx",
        ),
        RealModel(
            "keyword_tuple",
            "The token tagger returning a tuple (output='tuple').",
            seeded(lambda: _tagger_call("tuple")),
            capture="fx",
        ),
        RealModel(
            "inplace_mlp",
            "Residual MLP of width 256 written with mul_/add_, relu(inplace=True) and slice assignment "
            "(which FX cannot trace); batch 512.",
            seeded(_build_inplace_mlp),
            capture="export",
        ),
        RealModel(
            "tied_lm",
            "Language model whose lm_head.weight is its embedding.weight (one Parameter), 4 MLP blocks of "
            "width 128, vocabulary 1024; tokens (8, 64).",
            seeded(_build_tied_lm),
            capture="fx",
        ),
        RealModel(
            "hooked_mlp",
            "6 residual MLP blocks of width 128 with a counting forward hook, an output-halving forward hook "
            "and an input-doubling forward pre-hook; batch 256.",
            seeded(_build_hooked_mlp),
            capture="fx",
        ),
        RealModel(
            "branching_root",
            "4 residual MLP blocks of width 128, run forwards or backwards by the sign of the input's "
            "mean in the root forward; batch 256.",
            seeded(_build_branching_root),
            capture="module",
        ),
        RealModel(
            "hf_t5_long_source",
            "Hugging Face T5 encoder-decoder, 3 + 3 layers, width 64: 128 source tokens whose encoder "
            "output every decoder layer reads, 16 target tokens; batch 4.",
            seeded(_build_hf_t5_long_source),
            capture="export",
            requires=HUGGING_FACE,
        ),
        *(
            RealModel(
                name,
                description,
                seeded(_dag_call(name)),
                capture="fx",
                routes_by_value=name in ROUTED_BY_VALUE,
            )  # fmt: skip
            for name, description in DAG_DESCRIPTIONS.items()
        ),
    )
}


LIBRARY_ZOO: dict[str, RealModel] = {
    entry.name: entry
    for entry in (
        RealModel(
            "diffusers_unet",
            "diffusers UNet2DModel from a config: 2 levels of 16/32 channels, one ResNet block each, "
            "attention at the second, GroupNorm of 8 groups; images (4, 3, 16, 16) and timesteps (4,).",
            seeded(_build_diffusers_unet),
            capture="export",
            requires=DIFFUSERS,
        ),
        RealModel(
            "hf_clip",
            "Hugging Face CLIPModel with its contrastive loss: text and vision towers of 2 layers, width "
            "64, causal text attention; input_ids (4, 32), pixel_values (4, 3, 32, 32), patch 8.",
            seeded(_build_hf_clip),
            capture="export",
        ),
        RealModel(
            "hf_albert",
            "Hugging Face AlbertForMaskedLM: one layer's weights shared by all 4 layers (width 64, "
            "embedding 32); input_ids and labels (4, 32).",
            seeded(_build_hf_albert),
            capture="export",
        ),
    )
}
"""Models beyond `REAL_ZOO` for the hand methods' test, the captured module's cost and the side-by-side
bench; not in `REAL_ZOO`, so that not every real-zoo test runs them. `build_call` builds them too. The
diffusers UNet has its library's own switch (timm is not installed here: pyproject.toml says why);
CLIP's loss reads its batch as an int, which the export specialises (its causal mask was kept until
NOTE [materialised masks] judged masks made of such sizes too); ALBERT runs one layer four times, and
checkpointing that one instance, every call of it, is its hand method (`shared_module_types` in
planner/testing/hand_methods.py)."""


def build_call(name: str) -> ExampleCall:
    """Build the entry `name` of `REAL_ZOO` or `LIBRARY_ZOO`: a fresh model in train mode and its
    example call."""
    try:
        entry = REAL_ZOO.get(name) or LIBRARY_ZOO[name]
    except KeyError as error:
        valid = ", ".join((*REAL_ZOO, *LIBRARY_ZOO))
        raise KeyError(f"no real-zoo model named {name!r}; valid names: {valid}") from error
    return entry.build()
