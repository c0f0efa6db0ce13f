"""The attention masks a trace materialises where the model makes none (NOTE [materialised masks] in
planner/capture/attention_masks.py): dropped, or made `is_causal=True`, only where sizes alone make them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import planner
from planner.capture.attention_masks import ATTENTION
from planner.capture.chain import capture
from planner.testing.steps import assert_same_step, one_step
from planner.testing.zoo_real import build_call

BATCH, SEQUENCE, WIDTH, HEADS = 4, 24, 32, 4
FIXED_BATCH = " (batch read as len(x))"
"""A kind's suffix: the forward reads its batch as a Python int, which the export specialises."""


class MaskedAttention(nn.Module):
    """One attention layer whose mask is built in its forward, the way Hugging Face's masking utilities
    build one under tracing; `**options` makes torch.fx give up, so the model is exported."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, padding: torch.Tensor, **options: Any) -> torch.Tensor:
        batch, sequence, _ = x.shape
        q, k, v = self.qkv(x).view(batch, sequence, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        query = torch.arange(sequence)[:, None]
        key = torch.arange(sequence)[None, :]
        masks = {
            "nothing": key >= 0,
            "causal": key <= query,
            "window": (query - key).abs() <= 2,
            "padding": padding[:, None, None, :] > 0,
            "zeros": torch.zeros(sequence, sequence),
        }
        mask = masks[self.kind.removesuffix(FIXED_BATCH)].expand(batch, 1, sequence, sequence)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        loss = self.out(attended.transpose(1, 2).reshape(batch, sequence, WIDTH)).square().mean()
        if self.kind.endswith(FIXED_BATCH):  # CLIP's contrastive labels: torch.arange(len(logits))
            loss = loss + torch.arange(len(x)).float().mean()
        return loss


def example(kind: str) -> tuple[MaskedAttention, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    padding = torch.ones(BATCH, SEQUENCE)
    padding[:, -3:] = 0
    return MaskedAttention(kind), (torch.randn(BATCH, SEQUENCE, WIDTH), padding)


def attention_calls(kind: str) -> list[tuple[Any, bool]]:
    model, inputs = example(kind)
    captured = capture(model, inputs, {})
    assert captured.path == "export"
    calls = captured.graph_module.graph.find_nodes(op="call_function", target=ATTENTION)
    return [
        (node.args[3] if len(node.args) > 3 else None, bool(node.kwargs.get("is_causal"))) for node in calls
    ]


@pytest.mark.parametrize(
    ("kind", "is_causal"), [("nothing", False), ("causal", True), (f"causal{FIXED_BATCH}", True)]
)
def test_a_mask_made_of_sizes_alone_goes(kind: str, is_causal: bool) -> None:
    """A mask made of a specialised size (the batch) as well is judged as well: Hugging Face's CLIP, whose
    loss reads its batch as `len(logits)`, kept a float causal mask in each of its text tower's layers
    (32 KiB more than the model at batch 4 and 32 tokens)."""
    assert attention_calls(kind) == [(None, is_causal)]


@pytest.mark.parametrize("kind", ["window", "padding", "zeros"])
def test_a_mask_that_masks_something_else_reads_an_input_or_is_additive_stays(kind: str) -> None:
    ((mask, is_causal),) = attention_calls(kind)
    assert mask is not None and not is_causal


@pytest.mark.parametrize("kind", ["nothing", "causal", f"causal{FIXED_BATCH}", "window", "padding", "zeros"])
def test_the_captured_module_trains_as_the_model_and_costs_no_more(kind: str) -> None:
    model, inputs = example(kind)
    plan = planner.optimize(copy.deepcopy(model), inputs, budget_bytes=2**40)
    assert plan.module is not None
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs))
    model_bytes, module_bytes = (
        planner.measure(copy.deepcopy(m), inputs).peak_bytes for m in (model, plan.module)
    )
    assert module_bytes <= model_bytes


def test_a_dropped_mask_is_dropped_at_every_batch_and_sequence() -> None:
    """The graph is dynamic in batch and sequence, and the mask was checked at other sizes than the
    example's: the captured module runs a longer, larger call as the model does."""
    model, _ = example("causal")
    plan = planner.optimize(copy.deepcopy(model), example("causal")[1], budget_bytes=2**40)
    assert plan.module is not None
    torch.manual_seed(1)
    longer = (torch.randn(2 * BATCH, SEQUENCE + 5, WIDTH), torch.ones(2 * BATCH, SEQUENCE + 5))
    with pytest.warns(planner.LargerShapeWarning):
        assert_same_step(one_step(model, longer), one_step(plan.module, longer))


Call = tuple[int, bool, bool, bool, float]
"""How attention is called: key heads, without a mask, `is_causal`, `enable_gqa`, `dropout_p`."""


def _call(key_heads: int, arguments: tuple[Any, ...], options: dict[str, Any]) -> Call:
    def argument(name: str, position: int, default: Any) -> Any:
        return options.get(name, arguments[position] if len(arguments) > position else default)

    return (
        key_heads,
        argument("attn_mask", 3, None) is None,
        bool(argument("is_causal", 5, False)),
        bool(options.get("enable_gqa", False)),
        float(argument("dropout_p", 4, 0.0)),
    )


class EagerAttention(TorchFunctionMode):
    """Each `scaled_dot_product_attention` call of an eager forward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append(_call(args[1].shape[1], args, kwargs))
        return func(*args, **kwargs)


def graph_attention(graph_module: torch.fx.GraphModule) -> list[Call]:
    return [
        _call(node.args[1].meta["val"].shape[1], node.args, dict(node.kwargs))
        for node in graph_module.graph.find_nodes(op="call_function", target=ATTENTION)
    ]


EXPORTED_WITH_ATTENTION = ["hf_gpt2", "hf_bert", "hf_llama", "hf_t5", "hf_vit"]


@pytest.mark.parametrize("name", EXPORTED_WITH_ATTENTION)
def test_the_captured_graph_calls_attention_as_the_model_does_in_eager(name: str) -> None:
    """On a GPU the kernel, and so the dropout draws, follow how attention is called (NOTE [grouped
    heads]): each call of the graph has the model's key heads, mask or none, `is_causal`, `enable_gqa`
    and dropout. Llama's 4 heads over 2 key-value heads go with `enable_gqa=True` and no mask; T5's
    cross-attention keeps the zero float mask it makes in eager."""
    call = build_call(name)
    with EagerAttention() as eager, torch.no_grad():
        call.model(*call.args, **call.kwargs)
    captured = capture(call.model, call.args, call.kwargs)
    assert captured.path == "export"
    assert eager.calls and graph_attention(captured.graph_module) == eager.calls
    if name == "hf_llama":
        assert eager.calls == [(2, True, True, True, 0.1)] * 2
