"""The attention kernel the planned device would run, for a model profiled on the meta device.

Why it exists: `F.scaled_dot_product_attention` picks its kernel by device. On the meta device it runs
the math fallback, which makes the batch x heads x sequence x sequence scores, their softmax and mask,
and autograd saves them. A GPU runs FlashAttention or memory-efficient attention, and the CPU its own
flash kernel; these save the output and one log-sum-exp per query row instead. For a 7B Llama-style
model at sequence 4,096 the math path holds about 2.7 GiB per layer and sample where flash holds
0.03 GiB, so a plan made on meta for an H100 would count memory the H100 never allocates, and
`planner.capacity` would answer with a batch several times too small.

`planned_attention(spec)` is a TorchFunctionMode, active while interpreter.py profiles a model whose
tensors are on the meta device, that sends each call (as a function, or as the ATen operator an
exported graph calls) to the kernel the planned device would pick, whose meta kernel and autograd
formula PyTorch ships:

- `device_type="cuda"`: FlashAttention for fp16/bf16 without an explicit mask and with a head size of
  at most 256, else memory-efficient attention, which takes masks and fp32 (PyTorch's order on sm80 and
  later GPUs: flash, efficient, math). A boolean mask becomes an additive one first, as PyTorch's
  dispatcher does. cuDNN attention, which PyTorch may prefer on some GPUs, saves what flash saves.
- `device_type="cpu"`: whatever `torch._fused_sdp_choice` picks for the same call on the CPU (asked on
  stand-ins with one batch row); its flash kernel, or nothing to change when it picks math (dropout).

A call with `enable_gqa=True` (grouped key-value heads; NOTE [grouped heads] in
planner/capture/attention_masks.py) is planned with its key and value heads repeated first, as
Hugging Face's `repeat_kv` does: the fused kernels then save the repeated heads, where a GPU's grouped
kernels save the unrepeated ones, so its saved bytes are an upper bound. Left to the math path it
would count the scores instead, gigabytes a layer at long sequences. Planning on real tensors needs
none of this: the real kernel runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from planner.profiler.cost_model import DeviceSpec

__all__ = ["FLASH_MAX_HEAD_SIZE", "planned_attention"]

FLASH_MAX_HEAD_SIZE = 256
"""Largest head size FlashAttention-2 in PyTorch takes."""

FLASH_DTYPES = (torch.float16, torch.bfloat16)

_SDPA_CALLS: tuple[Callable[..., Any], ...] = (
    F.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)

_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _bound(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, with scaled_dot_product_attention's defaults."""
    bound: dict[str, Any] = {
        "attn_mask": None,
        "dropout_p": 0.0,
        "is_causal": False,
        "scale": None,
        "enable_gqa": False,
    }
    bound.update(zip(_SDPA_PARAMETERS, args, strict=False))
    bound.update(kwargs)
    return bound


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the additive bias the fused kernels take."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def _cuda_attention(call: dict[str, Any]) -> torch.Tensor | None:
    """The fused kernel's output, or None where the math path would run (both kernels switched off by
    `torch.nn.attention.sdpa_kernel` or `torch.backends.cuda`)."""
    query, key, value = call["query"], call["key"], call["value"]
    flash = (
        torch.backends.cuda.flash_sdp_enabled()
        and call["attn_mask"] is None
        and query.dtype in FLASH_DTYPES
        and query.shape[-1] <= FLASH_MAX_HEAD_SIZE
        and query.shape[-1] == value.shape[-1]
    )
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, call["dropout_p"], call["is_causal"], False, scale=call["scale"]
        )[0]
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return None
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query,
        key,
        value,
        _additive_mask(call["attn_mask"], query.dtype),
        query.requires_grad or key.requires_grad or value.requires_grad,
        call["dropout_p"],
        call["is_causal"],
        scale=call["scale"],
    )[0]


def _ungrouped(call: dict[str, Any]) -> dict[str, Any]:
    """`call` with each key and value head repeated for the query heads it serves (the module
    docstring says why)."""
    query_heads, key_heads = call["query"].shape[-3], call["key"].shape[-3]
    repeats = query_heads // key_heads
    return {
        **call,
        "key": call["key"].repeat_interleave(repeats, dim=-3),
        "value": call["value"].repeat_interleave(repeats, dim=-3),
        "enable_gqa": False,
    }


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor like `tensor`, with one batch row where it has four dimensions."""
    shape = (1, *tensor.shape[1:]) if tensor.dim() == 4 else tuple(tensor.shape)
    return torch.empty(shape, dtype=tensor.dtype, device="cpu")


def _cpu_picks_flash(call: dict[str, Any]) -> bool:
    """Whether the CPU's dispatcher runs its flash kernel for this call (asked on one-row stand-ins)."""
    from torch.nn.attention import SDPBackend

    mask = call["attn_mask"]
    choice = torch._fused_sdp_choice(
        _stand_in(call["query"]),
        _stand_in(call["key"]),
        _stand_in(call["value"]),
        None if mask is None else _stand_in(mask),
        call["dropout_p"],
        call["is_causal"],
        scale=call["scale"],
    )
    return bool(choice == SDPBackend.FLASH_ATTENTION.value)


def _cpu_attention(call: dict[str, Any]) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        call["query"],
        call["key"],
        call["value"],
        call["dropout_p"],
        call["is_causal"],
        attn_mask=call["attn_mask"],
        scale=call["scale"],
    )[0]


class planned_attention(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch's modes
    """Run scaled-dot-product attention on meta tensors as `spec`'s device would (see module docstring)."""

    def __init__(self, spec: DeviceSpec) -> None:
        super().__init__()
        self.device_type = spec.device_type

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA_CALLS:
            return func(*args, **kwargs)
        call = _bound(args, kwargs)
        if not call["query"].is_meta:
            return func(*args, **kwargs)
        if call["enable_gqa"]:
            call = _ungrouped(call)
        if self.device_type == "cuda":
            fused = _cuda_attention(call)
            return func(*args, **kwargs) if fused is None else fused
        if self.device_type == "cpu" and _cpu_picks_flash(call):
            return _cpu_attention(call)
        return func(*args, **kwargs)
