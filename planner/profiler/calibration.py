"""Calibration: a profiled node's measured peaks become the workspace no schedule changes.

Why it exists: the profiling step (interpreter.py) measures the live bytes at each node's forward,
backward, first unpack and last save. What the simulator predicts there without checkpointing is
subtracted (NOTE [measured residuals] in ir.py), so what remains is the node's own transient memory,
and the simulator predicts the measured step exactly. This is the profiler's one use of the
simulator, apart from the running of the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from planner.ir import ActivationGraph, Phase
from planner.simulation.replay import stops_before_outputs
from planner.simulation.step import simulate, store_everything

__all__ = ["MeasuredPeaks", "calibrate_workspace"]


class MeasuredPeaks(Protocol):
    """What a profiler measured of one node, for `calibrate_workspace`."""

    forward_peak_bytes: int
    backward_peak_bytes: int | None
    unpack_live_bytes: int | None
    last_pack_peak_bytes: int | None
    released_backward_peak_bytes: int | None


def calibrate_workspace(graph: ActivationGraph, measured: Mapping[str, MeasuredPeaks]) -> ActivationGraph:
    """Set each node's workspace to measured peak minus the simulator's prediction without them
    (NOTE [measured residuals] in ir.py); `measured` is keyed by node name.

    NOTE [freed part way in eager backward]: the simulator holds a node's saved storages, and counts all
    its parameter gradients, through the node's whole backward. A node that is many autograd operators
    (a module call the capture keeps opaque: a mixture of experts' block with its routing in its own
    `forward`) frees what each operator saved as its backward goes, so its measured backward peak can be
    below that prediction, and a residual clamped at zero predicts the node, and every plan's peak set
    there, too high (issue 35: a whole checkpointed block 1.46 MB above what `checkpoint_wrapper` on it
    measures). Such a node gets one `backward_points` entry (NOTE [early release] in
    simulation/step.py): the measured peak as a workspace on top of everything but the storages it saves
    first, with those as freed before it. Where a schedule releases them at the node (its own saves, or
    their replay's copies) the node is predicted as measured; where it holds any for a later node, that
    storage counts in full, as before. A replay the node triggers stops at its last save
    (`replay_stop_bytes`, NOTE [early stop]), before the operators after it run.

    NOTE [replay's early frees]: autograd holds a saved tensor until the backward of the operator that
    saved it is done, and frees it then; non-reentrant checkpoint hands autograd its replay's tensors on
    unpack and keeps none itself, so a replayed tensor is freed as soon as the backward formula is done
    with it, before the formula's last outputs are made. A Linear's recomputed input goes before its bias
    gradient: checkpointing every block of `branching_root` measured 512 bytes under the block's backward
    peak without checkpointing, and its lowest peak, that schedule, was predicted 512 bytes above what the
    hand method measures, so a budget the hand method keeps was refused. The profiling step runs again
    with every saved tensor freed on unpack (`release_on_unpack` in interpreter.py), and a node whose
    backward peaked lower there gets the difference as `replay_release_bytes`: the simulator takes it off
    the node's backward workspace where every storage it saves is the replay's copy and leaves at it
    (NOTE [early release] in simulation/step.py), a workspace below zero included, where the node's peak is a
    moment after its saves are freed (an opaque node's `backward_points`: `moe_transformer`'s every block
    was 512 bytes high, at its routed mixture's backward, while that went uncounted). Every graph is
    measured twice, not only those with nodes of many operators: a captured `linear` is several operators
    too, and Hugging Face BERT's every-layer schedule, what its own switch checkpoints, was predicted 512
    bytes above its measurement and so refused at the switch's measured peak, where we planned four
    regions instead (on an H200, 1.06x the switch's step time). The second step adds about a fifth to
    profiling (hf_bert 2.8 to 3.4 s)."""
    trace = simulate(graph, store_everything(graph)).trace
    forward_predicted = {step.node: step.live_bytes for step in trace if step.phase is Phase.FORWARD}
    backward_predicted = {step.node: step.live_bytes for step in trace if step.phase is Phase.BACKWARD}
    first_saver: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.saves:
            first_saver.setdefault(name, index)
    calibrated = []
    for index, node in enumerate(graph.nodes):
        record = measured[node.name]
        forward_workspace = max(0, record.forward_peak_bytes - forward_predicted[node.name])
        backward_workspace = 0
        backward_points = node.backward_points
        if record.backward_peak_bytes is not None:
            residual = record.backward_peak_bytes - backward_predicted[node.name]
            released = tuple(name for name in node.saves if first_saver[name] == index)
            if residual < 0 and released and not backward_points:
                released_bytes = sum(graph.storage_bytes[name] for name in released)
                backward_points = ((max(0, residual + released_bytes), released),)
            backward_workspace = max(0, residual)
        created_bytes = sum(graph.storage_bytes[name] for name in node.creates)
        # What was live before the node: its forward step less what it creates and its workspace.
        before_forward = forward_predicted[node.name] - created_bytes - node.forward_workspace_bytes
        replay_stop = None
        if record.last_pack_peak_bytes is not None and not stops_before_outputs(node):
            stop_bytes = max(0, record.last_pack_peak_bytes - before_forward)
            if stop_bytes < created_bytes + forward_workspace:
                replay_stop = stop_bytes
        replay_release = 0
        if record.backward_peak_bytes is not None and record.released_backward_peak_bytes is not None:
            replay_release = max(0, record.backward_peak_bytes - record.released_backward_peak_bytes)
        replay_workspace = None
        if record.unpack_live_bytes is not None:
            # The node's own parameter gradients are not made yet when it unpacks (nor in the replay).
            before_node = backward_predicted[node.name] - node.parameter_gradient_bytes
            replay_workspace = max(0, record.unpack_live_bytes - before_node)
        calibrated.append(
            dataclasses.replace(
                node,
                forward_workspace_bytes=forward_workspace,
                backward_workspace_bytes=backward_workspace,
                backward_points=backward_points,
                replay_workspace_bytes=replay_workspace,
                replay_stop_bytes=replay_stop,
                replay_release_bytes=replay_release,
            )
        )
    return dataclasses.replace(graph, nodes=tuple(calibrated))
