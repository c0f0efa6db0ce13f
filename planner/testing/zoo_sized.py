"""Library models at the sizes where issue 35 timed our plans against the libraries' own switch.

Why it exists: a plan's step time against a hand method's is decided by more than its recompute (the
Python around a checkpointed region, the captured graph's calls), and those costs weigh differently at
CI size than at a size people train on a CPU. Issue 35 found our plans slower than Hugging Face's
`gradient_checkpointing_enable()` at its memory on a 6-layer Qwen2 (1.05x), a Llama with LoRA adapters
(1.07x), GPT-2 with dropout (1.10x) and a top-2 Mixtral, and faster than timm's
`set_grad_checkpointing()` on a ViT; these are those models, built from configs with random weights
(nothing downloaded), for `bench.compare --models` (not in its default run, whose zoo is CI-sized).
Each build runs under `zoo_real.SEED` and returns the model in train mode.

The timm ViT needs timm, which this project's CPU machines cannot install (pyproject.toml says why):
it is measured where timm is installed, on a lent GPU machine (docs/benchmark.md).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from planner.testing.zoo_real import HUGGING_FACE, ExampleCall, RealModel, seeded, transformers_module

__all__ = ["SIZED_ZOO"]

LAYERS, WIDTH, HEADS, KV_HEADS, FEED_FORWARD, VOCABULARY = 6, 256, 4, 2, 512, 1024
BATCH, TOKENS = 4, 128
PEFT = "peft"
"""The optional package the LoRA entry needs."""
TIMM = "timm"
"""The optional package the ViT entry needs; not in the dev extra (pyproject.toml says why)."""
IMAGES, IMAGE_SIZE, PATCH = 16, 64, 8


def _tokens(length: int = TOKENS) -> dict[str, torch.Tensor]:
    token_ids = torch.randint(VOCABULARY, (BATCH, length))
    return {"input_ids": token_ids, "labels": token_ids}


def _decoder_sizes(layers: int) -> dict[str, Any]:
    """The sizes the Llama-family configs (Qwen2, Llama, Mixtral) share, under their common names."""
    return {
        "num_hidden_layers": layers,
        "hidden_size": WIDTH,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": FEED_FORWARD,
        "vocab_size": VOCABULARY,
        "max_position_embeddings": 2 * TOKENS,
        "use_cache": False,
    }


def _build_qwen2() -> ExampleCall:
    hf = transformers_module()
    config = hf.Qwen2Config(**_decoder_sizes(LAYERS))
    return ExampleCall(hf.Qwen2ForCausalLM(config), kwargs=_tokens())


def _build_llama_lora() -> ExampleCall:
    hf = transformers_module()
    peft = importlib.import_module(PEFT)
    config = hf.LlamaConfig(**_decoder_sizes(4), bos_token_id=0, eos_token_id=0)
    adapters = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return ExampleCall(peft.get_peft_model(hf.LlamaForCausalLM(config), adapters), kwargs=_tokens())


def _build_mixtral() -> ExampleCall:
    hf = transformers_module()
    config = hf.MixtralConfig(**_decoder_sizes(4), num_local_experts=4, num_experts_per_tok=2)
    return ExampleCall(hf.MixtralForCausalLM(config), kwargs=_tokens())


def _build_gpt2_dropout() -> ExampleCall:
    hf = transformers_module()
    config = hf.GPT2Config(
        n_layer=LAYERS,
        n_embd=WIDTH,
        n_head=HEADS,
        vocab_size=VOCABULARY,
        n_positions=2 * TOKENS,
        use_cache=False,
    )
    return ExampleCall(hf.GPT2LMHeadModel(config), kwargs=_tokens(2 * TOKENS))


def _build_timm_vit() -> ExampleCall:
    try:
        vision_transformer = importlib.import_module(f"{TIMM}.models.vision_transformer")
    except ImportError as error:
        raise ImportError(
            "sized_timm_vit needs `timm` (pip install timm, with a torchvision built for this torch); "
            "it is not in the dev extra: pyproject.toml says why"
        ) from error
    model = vision_transformer.VisionTransformer(
        img_size=IMAGE_SIZE,
        patch_size=PATCH,
        embed_dim=WIDTH,
        depth=LAYERS,
        num_heads=HEADS,
        num_classes=10,
    )
    return ExampleCall(model, (torch.randn(IMAGES, 3, IMAGE_SIZE, IMAGE_SIZE),))


SIZED_ZOO: dict[str, RealModel] = {
    entry.name: entry
    for entry in (
        RealModel(
            "sized_qwen2",
            f"Hugging Face Qwen2ForCausalLM: {LAYERS} layers, width {WIDTH}, {HEADS} heads with "
            f"{KV_HEADS} KV heads, vocabulary {VOCABULARY}; tokens ({BATCH}, {TOKENS}).",
            seeded(_build_qwen2),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "sized_llama_lora",
            f"Hugging Face LlamaForCausalLM, 4 layers, width {WIDTH}, under PEFT LoRA adapters (r=8) on "
            f"q_proj and v_proj, base weights frozen; tokens ({BATCH}, {TOKENS}).",
            seeded(_build_llama_lora),
            capture="export",
            requires=PEFT,
        ),
        RealModel(
            "sized_mixtral",
            f"Hugging Face MixtralForCausalLM: 4 layers, width {WIDTH}, 4 experts, top-2 routing; tokens "
            f"({BATCH}, {TOKENS}).",
            seeded(_build_mixtral),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "sized_gpt2_dropout",
            f"Hugging Face GPT2LMHeadModel: {LAYERS} layers, width {WIDTH}, dropout 0.1, tied head; tokens "
            f"({BATCH}, {2 * TOKENS}).",
            seeded(_build_gpt2_dropout),
            capture="export",
            requires=HUGGING_FACE,
        ),
        RealModel(
            "sized_timm_vit",
            f"timm VisionTransformer: {LAYERS} blocks, width {WIDTH}, {HEADS} heads, patches of {PATCH}; "
            f"images ({IMAGES}, 3, {IMAGE_SIZE}, {IMAGE_SIZE}), the logits' sum as the loss.",
            seeded(_build_timm_vit),
            capture="fx",
            requires=TIMM,
        ),
    )
}
"""Not in `REAL_ZOO`: planning and timing them takes minutes, so no test suite runs them by default."""
