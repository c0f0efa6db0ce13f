"""The levers to pull when checkpointing cannot help, and what each would do to the peak, estimated.

Why it exists: when no checkpoint plan lowers the peak enough, the report (summary.py) and the CLI
(when no plan fits) say what else would: bf16 autocast, another optimizer, sharding, a smaller batch.
Those estimates are one idea, apart from the report that prints them (split from summary.py, issue
36).

NOTE [lever estimates]: a lever's effect is *estimated*, not predicted: the graph was profiled with
one dtype, one optimizer, one device and one batch size, so the report scales the components of the
two candidate peaks (forward/backward and the optimizer step) by a factor per lever and takes the
larger peak. The factors and their assumptions are in `LEVER_RULES`; each printed line repeats its
assumption and says "estimate".

Everything here reads plain data (ir.py) and the torch-free simulator; it never imports torch.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

from planner.errors import format_bytes
from planner.ir import NO_OPTIMIZER, ActivationGraph, Component, OptimizerName, Schedule
from planner.simulation.step import simulate
from planner.solvers import lowest_peak

__all__ = [
    "FORWARD_BACKWARD",
    "LEVER_RULES",
    "OPTIMIZER_STEP",
    "REPORT_WIDTH",
    "Lever",
    "LeverRule",
    "estimate_levers",
    "levers_at_lowest_peak",
    "peak_components",
    "render_levers",
]

FORWARD_BACKWARD = "forward/backward"
OPTIMIZER_STEP = "optimizer step"

REPORT_WIDTH = 104
"""Prose lines of the report wrap here, so it reads in a terminal and in a README code block."""


@dataclass(frozen=True)
class LeverRule:
    """A way to lower the peak other than checkpointing, as factors on the peak's components.

    `forward_backward` and `optimizer_step` map component names to the factor the lever applies in
    that phase; components not named keep their size. See NOTE [lever estimates].
    """

    name: str
    assumption: str
    forward_backward: Mapping[Component, float]
    optimizer_step: Mapping[Component, float]
    optimizers: tuple[str, ...] = ()
    """Optimizer names (lower case prefixes) the lever applies to; empty means any."""
    keeps_gradients: bool = False
    """The lever keeps every parameter's gradient alive through forward and backward (accumulation):
    the forward/backward peak then holds all of them (NOTE [accumulated gradients] in
    simulation/micro_batches.py)."""


SHARDING_DEVICES = 2
"""Devices in the sharding estimate: the smallest setup that shards, and the easiest to scale from."""

LEVER_RULES: tuple[LeverRule, ...] = (
    LeverRule(
        name="bf16 autocast",
        assumption="saved activations halve (matmul/conv inputs kept in bf16); fp32 weights, "
        "gradients and optimizer state unchanged",
        forward_backward={Component.ACTIVATIONS: 0.5, Component.RECOMPUTE: 0.5},
        optimizer_step={},
    ),
    LeverRule(
        name="8-bit Adam (e.g. bitsandbytes)",
        assumption="two 1-byte states per parameter instead of two fp32",
        forward_backward={Component.OPTIMIZER_STATE: 0.25},
        optimizer_step={Component.OPTIMIZER_STATE: 0.25},
        optimizers=(OptimizerName.ADAM,),
    ),
    LeverRule(
        name="SGD with momentum",
        assumption="one fp32 state per parameter instead of two",
        forward_backward={Component.OPTIMIZER_STATE: 0.5},
        optimizer_step={Component.OPTIMIZER_STATE: 0.5},
        optimizers=(OptimizerName.ADAM,),
    ),
    LeverRule(
        name="SGD without momentum",
        assumption="no optimizer state",
        forward_backward={Component.OPTIMIZER_STATE: 0.0},
        optimizer_step={Component.OPTIMIZER_STATE: 0.0},
        optimizers=(OptimizerName.SGD_MOMENTUM,),
    ),
    LeverRule(
        name=f"sharding over {SHARDING_DEVICES} devices (FSDP/ZeRO-3)",
        assumption=f"parameters, gradients, optimizer state and its step split {SHARDING_DEVICES} ways; "
        "ignores the gathered layer's transient",
        forward_backward=dict.fromkeys(
            (Component.PARAMETERS, Component.GRADIENTS, Component.OPTIMIZER_STATE), 1 / SHARDING_DEVICES
        ),
        optimizer_step=dict.fromkeys(
            (Component.PARAMETERS, Component.GRADIENTS, Component.OPTIMIZER_STATE, Component.WORKSPACE),
            1 / SHARDING_DEVICES,
        ),
    ),
    LeverRule(
        name="half the batch (2 accumulation steps)",
        assumption="inputs, activations and their temporaries scale with the batch; every gradient is "
        "alive from the second micro-batch on",
        forward_backward=dict.fromkeys(
            (Component.INPUTS, Component.ACTIVATIONS, Component.RECOMPUTE, Component.WORKSPACE), 0.5
        ),
        optimizer_step={Component.INPUTS: 0.5},
        keeps_gradients=True,
    ),
)


@dataclass(frozen=True)
class Lever:
    """The estimated peak if one lever were pulled (see NOTE [lever estimates])."""

    name: str
    estimated_peak_bytes: int
    saving_bytes: int
    assumption: str


def peak_components(graph: ActivationGraph, schedule: Schedule) -> dict[str, dict[Component, int]]:
    """Bytes by component at the forward/backward peak and at the optimizer step, under `schedule`."""
    # Only forward and backward: no optimizer step, and no unscaling or clipping after backward.
    forward_backward_only = dataclasses.replace(graph.step, max_grad_norm=None, grad_scaler=False)
    without_step = simulate(
        dataclasses.replace(graph, optimizer=NO_OPTIMIZER, step=forward_backward_only), schedule
    )
    components = {FORWARD_BACKWARD: dict(without_step.breakdown)}
    if graph.optimizer != NO_OPTIMIZER:
        static = graph.static
        components[OPTIMIZER_STEP] = {
            Component.PARAMETERS: static.parameter_bytes,
            Component.BUFFERS: static.buffer_bytes,
            Component.INPUTS: static.input_bytes,
            Component.OPTIMIZER_STATE: static.optimizer_state_bytes,
            Component.GRADIENTS: static.gradient_bytes,
            Component.WORKSPACE: static.optimizer_step_workspace_bytes,
        }
    return components


def _applies(rule: LeverRule, optimizer: str) -> bool:
    return not rule.optimizers or any(optimizer.lower().startswith(name) for name in rule.optimizers)


def estimate_levers(
    components: Mapping[str, Mapping[Component, int]], *, optimizer: str, gradient_bytes: int = 0
) -> list[Lever]:
    """Each applicable lever's estimated peak, from the components of each candidate peak.

    `components` maps a phase (`FORWARD_BACKWARD`, `OPTIMIZER_STEP`, or any single peak's name) to its
    bytes by component; a phase other than the optimizer step is scaled with the forward/backward
    factors. `gradient_bytes` (every parameter's gradient) is what a lever that keeps gradients
    alive puts in such a phase. Levers that would not lower the peak are kept: "bf16 does nothing
    here" is an answer.
    """
    current_bytes = max(sum(parts.values()) for parts in components.values())
    levers = []
    for rule in LEVER_RULES:
        if not _applies(rule, optimizer):
            continue
        estimated_bytes = 0
        for phase, parts in components.items():
            factors = rule.optimizer_step if phase == OPTIMIZER_STEP else rule.forward_backward
            if rule.keeps_gradients and phase != OPTIMIZER_STEP:
                parts = {**parts, Component.GRADIENTS: max(parts.get(Component.GRADIENTS, 0), gradient_bytes)}
            scaled = sum(round(size * factors.get(key, 1.0)) for key, size in parts.items())
            estimated_bytes = max(estimated_bytes, scaled)
        levers.append(
            Lever(
                name=rule.name,
                estimated_peak_bytes=estimated_bytes,
                saving_bytes=current_bytes - estimated_bytes,
                assumption=rule.assumption,
            )
        )
    return levers


def levers_at_lowest_peak(graph: ActivationGraph) -> list[Lever]:
    """The levers' estimates on top of the lowest-peak plan: what to try when no plan fits."""
    schedule, _ = lowest_peak(graph)
    return estimate_levers(
        peak_components(graph, schedule),
        optimizer=graph.optimizer,
        gradient_bytes=graph.static.accumulated_gradient_bytes,
    )


def render_levers(levers: list[Lever], indent: str = "    ") -> list[str]:
    """Two lines per lever: estimated peak and saving, then the assumption behind the estimate."""
    width = max((len(lever.name) for lever in levers), default=0)
    lines = []
    for lever in levers:
        lines += [
            f"{indent}{lever.name:<{width}}  ~{format_bytes(lever.estimated_peak_bytes):>11}  "
            f"(estimate, -{format_bytes(lever.saving_bytes)})",
            *textwrap.wrap(
                f"assumes {lever.assumption}",
                width=REPORT_WIDTH,
                initial_indent=f"{indent}  ",
                subsequent_indent=f"{indent}  ",
            ),
        ]
    return lines
