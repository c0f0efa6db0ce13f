"""Attention planned on the meta device runs the kernel the planned device would
(planner/profiler/attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import planner

BATCH, HEADS, SEQUENCE, HEAD_SIZE = 2, 4, 64, 16
WIDTH = HEADS * HEAD_SIZE


class Attention(nn.Module):
    """One multi-head attention layer on F.scaled_dot_product_attention, optionally masked."""

    def __init__(self, *, dropout: float = 0.0, masked: bool = False, grouped: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.dropout = dropout
        self.masked = masked
        self.grouped = grouped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, HEAD_SIZE)).permute(2, 0, 3, 1, 4)
        if self.grouped:  # half as many key-value heads, each serving two query heads
            k, v = k[:, : HEADS // 2], v[:, : HEADS // 2]
        mask = None
        if self.masked:
            mask = torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool, device=x.device).tril()
        attended = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout,
            is_causal=not self.masked,
            enable_gqa=self.grouped,
        )
        return self.out(attended.transpose(1, 2).flatten(2))


def _graph(model: nn.Module, x: torch.Tensor, device: str) -> planner.Plan:
    return planner.optimize(
        model, (x,), budget_bytes=2**40, cost_model="analytic", device=device, solver="none"
    )


def _build(meta: bool, **options: object) -> tuple[nn.Module, torch.Tensor]:
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(0)
        return Attention(**options), torch.randn(BATCH, SEQUENCE, WIDTH)  # type: ignore[arg-type]


SCORES_BYTES = BATCH * HEADS * SEQUENCE * SEQUENCE * 4
"""One fp32 batch x heads x sequence x sequence tensor: what the math path makes and saves."""


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_meta_planned_for_the_cpu_equals_the_real_cpu_graph(dropout: float) -> None:
    real = _graph(*_build(False, dropout=dropout), "cpu")
    meta = _graph(*_build(True, dropout=dropout), "cpu")
    assert meta.graph.storage_bytes == real.graph.storage_bytes
    assert meta.baseline_peak_bytes == real.baseline_peak_bytes
    # The CPU runs flash attention without dropout and the math path with it.
    assert (max(real.graph.storage_bytes.values()) >= SCORES_BYTES) == (dropout > 0)


def test_meta_planned_for_a_gpu_saves_no_scores_unless_the_fused_kernels_are_off() -> None:
    fused = _graph(*_build(True), "h100")
    assert max(fused.graph.storage_bytes.values()) < SCORES_BYTES
    attention = next(node for node in fused.graph.nodes if "scaled_dot_product" in node.op)
    saved = sorted(fused.graph.storage_bytes[name] for name in attention.saves)
    # FlashAttention keeps its output and one fp32 log-sum-exp per query row (beside q, k and v).
    assert BATCH * HEADS * SEQUENCE * 4 in saved and BATCH * SEQUENCE * WIDTH * 4 in saved
    with sdpa_kernel(SDPBackend.MATH):
        math_path = _graph(*_build(True), "h100")
    assert max(math_path.graph.storage_bytes.values()) >= SCORES_BYTES
    assert math_path.baseline_peak_bytes > fused.baseline_peak_bytes


def test_a_masked_call_planned_for_a_gpu_uses_memory_efficient_attention() -> None:
    masked = _graph(*_build(True, masked=True), "h100")
    assert max(masked.graph.storage_bytes.values()) < SCORES_BYTES
    with sdpa_kernel(SDPBackend.MATH):
        math_path = _graph(*_build(True, masked=True), "h100")
    assert masked.baseline_peak_bytes < math_path.baseline_peak_bytes


def test_grouped_heads_planned_for_a_gpu_save_no_scores() -> None:
    """`enable_gqa=True` (what NOTE [grouped heads] makes of Hugging Face's repeated heads) is planned on
    the fused kernel with the key-value heads repeated, not on the math path."""
    grouped = _graph(*_build(True, grouped=True), "h100")
    assert max(grouped.graph.storage_bytes.values()) < SCORES_BYTES
    with sdpa_kernel(SDPBackend.MATH):
        math_path = _graph(*_build(True, grouped=True), "h100")
    assert max(math_path.graph.storage_bytes.values()) >= SCORES_BYTES
