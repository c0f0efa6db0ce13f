"""A profiled graph as the micro-batch of a training step that sets its forward/backward peak.

Why it exists: a graph is profiled as one micro-batch, but users accumulate gradients, clip them and
zero them in more than one way (`TrainingStep`, ir.py). Turning the graph into the highest micro-batch's
graph once, here, lets the solvers and the simulator (step.py) work on one graph with no notion of
micro-batches.

NOTE [accumulated gradients]: a graph is profiled as one micro-batch after `zero_grad(set_to_none=True)`:
parameter gradients appear as backward reaches them. From the second micro-batch on (in every
micro-batch with `set_to_none=False`), every parameter's `.grad` is alive from the start of forward,
and in backward autograd's AccumulateGrad adds each newly computed gradient into `.grad` in place and
frees it: the new gradient is a transient of the node that makes it (measured on the CPU). That
micro-batch is at least as high as the first at every point (the first holds only the gradients made
so far), so it sets the forward/backward peak. `for_training_step` turns the profiled graph into that
micro-batch's graph: the parameters' gradients become resident (`StaticBytes.resident_gradient_bytes`)
and each node's `parameter_gradient_bytes` moves into its backward workspace. Solvers and the
simulator then need no notion of micro-batches. Input gradients are new tensors in every micro-batch;
they are made by the first nodes, at the very end of backward, so counting them as transients there
changes nothing measurable.

A step that zeroes gradients between forward and backward (NOTE [loop orders] in ir.py) and keeps none
between micro-batches is the first micro-batch with the last step's gradients alive through its forward:
`StaticBytes.forward_gradient_bytes`, which the simulator and the solvers count on forward points alone.
With accumulation it is the resident case above, whose later micro-batches are at least as high.
"""

from __future__ import annotations

import dataclasses

from planner.ir import ActivationGraph, TrainingStep

__all__ = ["describe_micro_batch", "for_training_step"]


def for_training_step(graph: ActivationGraph, step: TrainingStep) -> ActivationGraph:
    """`graph`, profiled as one micro-batch, as the highest micro-batch of `step` sees it (NOTE
    [accumulated gradients]); unchanged when the step keeps no gradient between micro-batches."""
    if graph.step == step:
        return graph
    if graph.step != TrainingStep():
        raise ValueError(
            f"this graph already describes {graph.step}; apply a training step to the graph as profiled "
            "(planner.optimize(..., step=...) profiles it again)"
        )
    if not step.gradients_resident:
        forward_bytes = graph.static.accumulated_gradient_bytes if step.zero_grad_before_backward else 0
        static = dataclasses.replace(graph.static, forward_gradient_bytes=forward_bytes)
        return dataclasses.replace(graph, static=static, step=step)
    nodes = tuple(
        dataclasses.replace(
            node,
            backward_workspace_bytes=node.backward_workspace_bytes + node.parameter_gradient_bytes,
            backward_points=tuple(
                (workspace_bytes + node.parameter_gradient_bytes, freed)
                for workspace_bytes, freed in node.backward_points
            ),
            parameter_gradient_bytes=0,
        )
        for node in graph.nodes
    )
    resident_bytes = graph.static.accumulated_gradient_bytes
    static = dataclasses.replace(graph.static, resident_gradient_bytes=resident_bytes)
    return dataclasses.replace(graph, nodes=nodes, static=static, step=step)


def describe_micro_batch(step: TrainingStep) -> str:
    """Which micro-batch sets a forward/backward peak under `step`, in words (empty for one micro-batch
    that starts with no gradient)."""
    if not step.gradients_resident:
        if step.zero_grad_before_backward:
            return "with the last step's gradients alive through the forward (zero_grad before backward)"
        return ""
    if step.zero_grad_set_to_none:
        return "in the second micro-batch (and every later one), with all gradients alive"
    return "in every micro-batch, with all gradients alive (zero_grad(set_to_none=False) keeps them)"
