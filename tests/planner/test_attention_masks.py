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
        }
        mask = masks[self.kind].expand(batch, 1, sequence, sequence)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(attended.transpose(1, 2).reshape(batch, sequence, WIDTH)).square().mean()


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


@pytest.mark.parametrize(("kind", "is_causal"), [("nothing", False), ("causal", True)])
def test_a_mask_made_of_sizes_alone_goes(kind: str, is_causal: bool) -> None:
    assert attention_calls(kind) == [(None, is_causal)]


@pytest.mark.parametrize("kind", ["window", "padding"])
def test_a_mask_that_masks_something_else_or_reads_an_input_stays(kind: str) -> None:
    ((mask, is_causal),) = attention_calls(kind)
    assert mask is not None and not is_causal


@pytest.mark.parametrize("kind", ["nothing", "causal", "window", "padding"])
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


class AttentionCalls(TorchFunctionMode):
    """How each `scaled_dot_product_attention` of an eager forward is called: key heads, mask or
    none, `is_causal`, `enable_gqa`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool, bool, bool]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append(
                (
                    args[1].shape[1],
                    kwargs.get("attn_mask") is None,
                    bool(kwargs.get("is_causal")),
                    bool(kwargs.get("enable_gqa")),
                )
            )
        return func(*args, **kwargs)


def test_grouped_heads_are_attended_as_in_eager() -> None:
    """NOTE [grouped heads]: with its causal mask gone, Hugging Face's Llama (4 heads over 2 key-value
    heads) is captured calling attention on the 2 heads with `enable_gqa=True`, as it runs in eager, and
    trains as the model does, attention dropout included."""
    call = build_call("hf_llama")
    with AttentionCalls() as eager, torch.no_grad():
        call.model(*call.args, **call.kwargs)
    captured = capture(call.model, call.args, call.kwargs)
    graph_calls = [
        (
            node.args[1].meta["val"].shape[1],
            (node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")) is None,
            bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)),
            bool(node.kwargs.get("enable_gqa")),
        )
        for node in captured.graph_module.graph.find_nodes(op="call_function", target=ATTENTION)
    ]
    assert eager.calls == [(2, True, True, True)] * 2
    assert graph_calls == eager.calls
    plan = planner.optimize(
        copy.deepcopy(call.model), call.args, example_kwargs=call.kwargs, budget_bytes=2**40
    )
    assert plan.module is not None
    assert_same_step(
        one_step(call.model, call.args, kwargs=call.kwargs),
        one_step(plan.module, call.args, kwargs=call.kwargs),
    )
