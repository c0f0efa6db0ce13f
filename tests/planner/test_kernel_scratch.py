"""NOTE [kernel scratch]: a compiled convolution's scratch memory, which no graph value shows, is in the
predicted peak.

A network of wide 3x3 convolutions on a small image, trained with SGD: each weight (144 KiB) is larger
than the activations (16 KiB), and mkldnn reorders weights and gradients inside every call, so the
scratch of one `convolution_backward` sets the step's peak. Without counting it the compiled step's
peak was predicted 11.5 % low (1105 KiB against 1249 measured); with it, exact on this machine.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import planner
from planner.compiled.kernel_scratch import scratch_bytes

PREDICTION_TOLERANCE = 0.01
HUGE_BUDGET_BYTES = 2**40


def _wide_convolutions() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers), (torch.randn(1, 64, 8, 8),)


def test_the_compiled_peak_counts_each_convolutions_scratch() -> None:
    model, inputs = _wide_convolutions()
    plan = planner.optimize(model, inputs, budget_bytes=HUGE_BUDGET_BYTES, compile=True, optimizer="sgd")
    assert plan.module is not None
    measured = planner.measure(plan.module, inputs, optimizer="sgd").peak_bytes
    error = abs(plan.predicted_peak_bytes - measured) / measured
    assert error <= PREDICTION_TOLERANCE, (
        f"predicted {plan.predicted_peak_bytes}, measured {measured} ({error:.1%})\n{plan.summary()}"
    )


def test_scratch_is_measured_for_a_convolution_and_the_outputs_it_unpacks() -> None:
    def backward(
        gradient: torch.Tensor, image: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grad_input, grad_weight, _ = torch.ops.aten.convolution_backward.default(
            gradient, image, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False]
        )
        return grad_input, grad_weight

    graph = make_fx(backward, tracing_mode="fake")(
        torch.randn(1, 64, 8, 8), torch.randn(1, 64, 8, 8), torch.randn(64, 64, 3, 3)
    )
    nodes = list(graph.graph.nodes)
    measured = scratch_bytes(nodes, channels_last=True)
    call = next(node for node in nodes if node.target is torch.ops.aten.convolution_backward.default)
    unpacked = [user for user in call.users]
    assert measured[call] > 0, "mkldnn's backward reorders the weight and gradient it computes with"
    assert all(measured[user] == measured[call] for user in unpacked)
    assert set(measured) == {call, *unpacked}


def test_a_profiler_already_running_is_left_running_and_scratch_is_not_measured() -> None:
    def forward(image: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        stride, padding, dilation, output_padding = [1, 1], [1, 1], [1, 1], [0, 0]
        return torch.ops.aten.convolution.default(
            image, weight, None, stride, padding, dilation, False, output_padding, 1
        )

    graph = make_fx(forward, tracing_mode="fake")(torch.randn(1, 32, 8, 8), torch.randn(48, 32, 3, 3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        measured = scratch_bytes(graph.graph.nodes, channels_last=False)
        torch.ones(4).sum()
    assert measured == {}
    assert any(event.name() == "aten::sum" for event in profile.profiler.kineto_results.events())


def _backward_of_a_concatenated_branch(
    gradient: torch.Tensor, image: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    branch_gradient = gradient[:, : image.shape[1]]
    grad_input, _, _ = torch.ops.aten.convolution_backward.default(
        branch_gradient, image, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False]
    )
    return grad_input


def test_a_sliced_gradient_is_probed_with_its_concatenations_strides() -> None:
    """NOTE [sliced arguments]: in channels-last the branch's gradient keeps the strides of the whole
    concatenation's, and mkldnn copies it into a dense one inside the call."""
    channels, image_shape = 16, (4, 16, 16, 16)
    graph = make_fx(_backward_of_a_concatenated_branch, tracing_mode="fake")(
        torch.randn(4, 2 * channels, 16, 16), torch.randn(image_shape), torch.randn(channels, channels, 3, 3)
    )
    nodes = list(graph.graph.nodes)
    dense_graph = make_fx(_backward_of_a_concatenated_branch, tracing_mode="fake")(
        torch.randn(image_shape), torch.randn(image_shape), torch.randn(channels, channels, 3, 3)
    )
    dense_nodes = list(dense_graph.graph.nodes)

    def call_scratch(of: list[torch.fx.Node]) -> int:
        call = next(node for node in of if node.target is torch.ops.aten.convolution_backward.default)
        return scratch_bytes(of, channels_last=True)[call]

    gradient_bytes = 4 * 16 * 16 * 16 * 4
    assert call_scratch(nodes) >= call_scratch(dense_nodes) + gradient_bytes
