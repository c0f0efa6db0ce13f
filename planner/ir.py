"""Plain data that flows between the planner's stages: the activation graph and the schedule.

Nothing here imports torch, so the solvers, the simulator and the REST service can work on a graph that
was captured elsewhere. Every size is in bytes and every time in milliseconds, and the names say so.

The graph is a list of nodes in one topological order (the order the model's forward ran them) plus
the storages they allocate. A storage is one block of tensor memory; views share their base's storage,
so memory is counted once per storage, never once per tensor. Static memory (parameters, buffers,
inputs, gradients, optimizer state) is summarised in `StaticBytes`; only activations are storages.

NOTE [measured residuals]: `forward_workspace_bytes` and `backward_workspace_bytes` are measured in one
profiling step without checkpointing. They hold what a schedule cannot change: kernels' temporaries and,
in backward, the gradients in flight and the parameter gradients produced so far. The simulator adds
them to the activation memory that a schedule does change (see simulate.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import networkx as nx

__all__ = [
    "GRAPH_SCHEMA",
    "PLAN_SCHEMA",
    "ActivationGraph",
    "Node",
    "Phase",
    "Region",
    "RegionPolicy",
    "Schedule",
    "SimulationResult",
    "StaticBytes",
    "TraceStep",
]

GRAPH_SCHEMA = "planner.graph/v1"
PLAN_SCHEMA = "planner.plan/v1"


@dataclass(frozen=True)
class Node:
    """One operation of the forward pass, with what it costs in memory and time."""

    name: str
    op: str
    module_path: str
    inputs: tuple[str, ...]
    creates: tuple[str, ...]
    """Storages this node allocates that outlive it: new outputs (not views) and tensors it saves."""
    reads: tuple[str, ...]
    """Activation storages this node takes as inputs."""
    saves: tuple[str, ...]
    """Activation storages autograd keeps for this node's backward (deduplicated by storage)."""
    saves_anything: bool
    """True when autograd saves any tensor for this node, parameters included; recompute starts there."""
    forward_ms: float
    backward_ms: float
    forward_workspace_bytes: int
    backward_workspace_bytes: int
    replay_workspace_bytes: int | None = None
    """Of the backward residual, what is live when the node's backward first unpacks a saved tensor (the
    gradients in flight): where a replay the node triggers runs (NOTE [early stop] in simulate.py).
    None where it was not measured (module-level and synthetic graphs)."""
    parameter_gradient_bytes: int = 0
    """Parameter (and input) gradient bytes that first appear during this node's backward."""
    allocated_bytes: int = 0
    """Every storage the node's operators allocate, freed inside the node or not: what a selective
    checkpoint policy caches when it keeps this node (see NOTE [selective keeps] in simulate.py)."""
    forward_flops: int = 0
    """FLOPs of the forward as `torch.utils.flop_counter` counts them (matmuls, convolutions)."""
    moved_bytes: int = 0
    """Bytes of the tensors the forward reads and writes: the memory-bound part of its cost."""
    operator_count: int = 1
    """Operators the forward dispatches: a selective checkpoint policy calls back once for each."""
    random: bool = False
    stateful: bool = False
    in_place: bool = False
    checkpointable: bool = True


@dataclass(frozen=True)
class StaticBytes:
    """Memory that no checkpoint schedule changes."""

    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    optimizer_step_workspace_bytes: int
    """Temporaries of `optimizer.step()` on top of parameters, gradients and state."""

    @property
    def resident_bytes(self) -> int:
        """Bytes live through forward and backward of a steady-state step (gradients set to None)."""
        return self.parameter_bytes + self.buffer_bytes + self.input_bytes + self.optimizer_state_bytes


@dataclass(frozen=True)
class ActivationGraph:
    """The model as the planner sees it: nodes in execution order, storages, static bytes."""

    nodes: tuple[Node, ...]
    storage_bytes: dict[str, int]
    static: StaticBytes
    capture: str
    """How the model was captured, e.g. "fx" or "fx (opaque: block.3)"."""
    optimizer: str
    timing: str = "measured"
    """Where per-node times come from: "measured" (profiling steps on the model's device) or
    "analytic (<device>)" (FLOPs and bytes on a roofline, see profile.py)."""
    selective_op_overhead_ms: float = 0.0
    """Time a selective checkpoint policy adds per dispatched operator of a region that keeps nodes
    (forward and replay together; see selective_cost.py)."""

    def index_of(self, name: str) -> int:
        """Position of the node called `name` in execution order."""
        for index, node in enumerate(self.nodes):
            if node.name == name:
                return index
        raise KeyError(
            f"no node named {name!r} in the graph; nodes are {[n.name for n in self.nodes][:8]}..."
        )

    def to_networkx(self) -> nx.DiGraph:
        """The data-flow graph, one vertex per node, for checks and drawing."""
        graph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.name, op=node.op)
        known = {node.name for node in self.nodes}
        for node in self.nodes:
            for source in node.inputs:
                if source in known:
                    graph.add_edge(source, node.name)
        return graph


class RegionPolicy(Enum):
    """What autograd does with the activations of a region."""

    STORE = "store"
    """Keep every saved activation until backward, as without checkpointing."""
    CHECKPOINT = "checkpoint"
    """Keep only the region's inputs; recompute its forward at the start of its backward."""


@dataclass(frozen=True)
class Region:
    """Nodes `start` (inclusive) to `stop` (exclusive) in execution order, under one policy.

    In a CHECKPOINT region, `keep` lists nodes (by index) whose outputs are saved in forward and not
    recomputed (a selective checkpoint policy): expensive matmuls kept, cheap pointwise ops replayed.
    """

    start: int
    stop: int
    policy: RegionPolicy
    keep: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """A partition of the nodes into consecutive regions, as produced by a solver."""

    regions: tuple[Region, ...]
    solver: str
    gap: float = 0.0
    """Proven optimality gap of the solver's answer within its plan space (0: optimal)."""

    @property
    def checkpointed(self) -> tuple[Region, ...]:
        return tuple(region for region in self.regions if region.policy is RegionPolicy.CHECKPOINT)


class Phase(Enum):
    """The part of a training step in which a memory peak occurs."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer step"


@dataclass(frozen=True)
class TraceStep:
    """Live bytes at one point of the simulated step, for readable failures and timeline plots."""

    phase: Phase
    node: str
    live_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class SimulationResult:
    """Predicted memory and time of one steady-state training step under a schedule."""

    peak_bytes: int
    peak_phase: Phase
    peak_node: str
    recompute_ms: float
    step_ms: float
    breakdown: dict[str, int]
    """Bytes by component at the peak: parameters, gradients, optimizer_state, inputs, activations, ..."""
    trace: tuple[TraceStep, ...] = field(repr=False, default=())

    @property
    def overhead(self) -> float:
        """Recompute time as a fraction of the step time without checkpointing."""
        return self.recompute_ms / self.step_ms if self.step_ms > 0 else 0.0
