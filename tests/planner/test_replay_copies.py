"""NOTE [replay copies] in planner/compiled/replay_copies.py: a pointwise backward operator that reads a
replayed value computes its own copy of that value's chain, so the replay's value dies with the replay.

Checked on a small backward graph written with aten operators; tests/planner/test_compiled_out_of_zoo.py
measures the CNN whose lowest plan it fixed.
"""

from __future__ import annotations

import torch
from torch import fx

from planner.compiled.replay_copies import copy_replays_for_readers

aten = torch.ops.aten


def _backward() -> tuple[fx.GraphModule, set[str]]:
    """A block's backward as the partition writes it when the plan replays the block: the ReLU of a
    saved convolution output is replayed for the next convolution, whose backward and the ReLU's mask
    read it too."""
    graph = fx.Graph()

    def call(name: str, target: torch._ops.OpOverload, *args: object) -> fx.Node:
        return graph.create_node("call_function", target, args, name=name)

    saved, scale = graph.placeholder("convolution_1"), graph.placeholder("rsqrt_1")
    weight, gradient = graph.placeholder("primals_16"), graph.placeholder("tangents_1")
    normed = call("mul_8", aten.mul.Tensor, saved, scale)
    relu = call("relu_1", aten.relu.default, normed)
    convolution = call(
        "convolution_2", aten.convolution.default, relu, weight, None, [1], [0], [1], False, [0], 1
    )
    backward = call(
        "convolution_backward",
        aten.convolution_backward.default,
        *(gradient, relu, weight, [0], [1], [0], [1], False, [0], 1, [True, True, False]),
    )
    mask = call("le_2", aten.le.Scalar, relu, 0)
    masked = call("where_2", aten.where.self, mask, gradient, gradient)
    graph.output((convolution, backward, masked))
    replayed = {normed.name, relu.name, convolution.name}
    return fx.GraphModule(torch.nn.Module(), graph), replayed


def _node(module: fx.GraphModule, name: str) -> fx.Node:
    return next(node for node in module.graph.nodes if node.name == name)


def test_the_mask_reads_its_own_copy_of_the_replayed_relu() -> None:
    module, replayed = _backward()
    copied, copies = copy_replays_for_readers(module, replayed)
    mask = _node(copied, "le_2")
    relu_copy = mask.args[0]
    assert (
        isinstance(relu_copy, fx.Node) and relu_copy.name in copies and relu_copy.target is aten.relu.default
    )
    normed_copy = relu_copy.args[0]
    assert isinstance(normed_copy, fx.Node) and normed_copy.name in copies
    assert [source.name for source in normed_copy.all_input_nodes] == ["convolution_1", "rsqrt_1"]
    assert copies == {relu_copy.name, normed_copy.name}


def test_the_replay_and_an_extern_reader_keep_the_replayed_value() -> None:
    """A convolution's backward is an extern kernel: a copy would be stored as the value is, so it
    reads the replayed value, which the model keeps for it."""
    module, replayed = _backward()
    copied, _ = copy_replays_for_readers(module, replayed)
    relu = _node(copied, "relu_1")
    assert {user.name for user in relu.users} == {"convolution_2", "convolution_backward"}


def test_a_backward_without_replays_is_unchanged() -> None:
    module, _ = _backward()
    before = [(node.name, node.args) for node in module.graph.nodes]
    copied, copies = copy_replays_for_readers(module, set())
    assert not copies
    assert [(node.name, node.args) for node in copied.graph.nodes] == before
