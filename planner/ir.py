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
them to the activation memory that a schedule does change (see simulation/step.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

import networkx as nx

__all__ = [
    "NO_OPTIMIZER",
    "Component",
    "CostModel",
    "OptimizerName",
    "BLOCK_BYTES",
    "COMPILED_CAPTURE",
    "GLUE_OP",
    "GRAPH_SCHEMA",
    "MemoryCounting",
    "PLAN_SCHEMA",
    "ActivationGraph",
    "BudgetKind",
    "Node",
    "Phase",
    "Region",
    "RegionPolicy",
    "Schedule",
    "Sharding",
    "SimulationResult",
    "StaticBytes",
    "TraceStep",
    "TrainingStep",
    "breakdown_from",
    "breakdown_to_json",
    "merge_stored",
]

GRAPH_SCHEMA = "planner.graph/v1"
PLAN_SCHEMA = "planner.plan/v1"
NO_OPTIMIZER = "none"
"""`ActivationGraph.optimizer` of a step without an optimizer (forward and backward only)."""


class OptimizerName(StrEnum):
    """The optimizers one can name (`optimizer="adam"`), as profiler/measurement.py's `make_optimizer` builds
    them; members are their string values, so names stay plain strings in JSON."""

    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAGRAD = "adagrad"
    ADAFACTOR = "adafactor"


class CostModel(StrEnum):
    """Where per-node times come from (`cost_model=` of optimize and profile). Members are their
    string values, so the plain strings are accepted and serialised as they are."""

    MEASURED = "measured"
    """Profiling steps on the model's device."""
    ANALYTIC = "analytic"
    """FLOPs and bytes on a roofline of a named device (profiler/cost_model.py); `timing` reads
    "analytic (<device>)"."""


class Sharding(StrEnum):
    """How data-parallel training places parameters, gradients and optimizer state (`sharding=` of
    optimize and profile; profiler/sharding.py counts a rank's bytes under each). Members are their
    string values."""

    DDP = "ddp"
    """Replicated on every rank (DistributedDataParallel), plus DDP's gradient buckets."""
    FSDP = "fsdp"
    """Split across ranks (FULL_SHARD, FSDP2 fully_shard), one unit gathered at a time."""


BLOCK_BYTES = 512
"""CUDA's caching allocator hands out memory in multiples of this (`kMinBlockSize` in
c10/cuda/CUDACachingAllocator.cpp), and `torch.cuda.max_memory_allocated` counts those blocks."""


class MemoryCounting(StrEnum):
    """How the bytes of one tensor storage are counted, in every figure a graph, a plan or a report
    holds (`memory_counting=` of optimize and profile). Members are their string values.

    NOTE [counted bytes]: a GPU does not count tensor bytes. CUDA's caching allocator rounds every
    allocation up to a multiple of 512 bytes (`round_size`: at least 512, then 512-byte steps), and
    `torch.cuda.max_memory_allocated`, the figure an out-of-memory error is about, adds those rounded
    sizes. Plans made on a CPU (in CI, on a laptop, on the meta device for a named card) are used on
    GPUs, so BLOCKS is the default on every device; on the CPU it overstates the peak by a fraction of
    a percent (a diffusion U-Net of many small tensors: 0.7 %). EXACT counts storage bytes as they
    are, for training on the CPU. A graph's every storage, static and workspace figure is counted
    its way, so a schedule's predicted peak is in the graph's counting with no conversion.
    """

    BLOCKS = "blocks"
    """As CUDA's caching allocator counts: `max(512, ceil(n / 512) * 512)` bytes per storage."""
    EXACT = "exact"
    """The storage's own bytes (what a CPU allocates)."""

    def of(self, size_bytes: int) -> int:
        """`size_bytes` of one storage (or one allocation) as this counting counts it; 0 stays 0,
        as an empty tensor allocates nothing."""
        if self is MemoryCounting.EXACT or size_bytes <= 0:
            return size_bytes
        return -(-size_bytes // BLOCK_BYTES) * BLOCK_BYTES

    @property
    def words(self) -> str:
        """What a report says the figures are."""
        if self is MemoryCounting.BLOCKS:
            return "counted in 512-byte blocks, as CUDA's caching allocator counts (max_memory_allocated)"
        return "exact tensor bytes (memory_counting='exact')"


class BudgetKind(StrEnum):
    """What a budget bounds (`budget_kind=` of optimize). Members are their string values.

    NOTE [budget kinds]: a GPU raises out-of-memory when CUDA's caching allocator cannot reserve more
    memory, and reserved memory holds what allocated memory does plus segment remainders and cached
    blocks best fit cannot reuse. ALLOCATED, the default, bounds the simulator's peak, each storage
    counted as the graph counts it (what `max_memory_allocated` reports, or the live-storage tracker on
    the CPU, which has no caching allocator). RESERVED bounds the reserved peak predicted by replaying
    the plan's allocations through simulation/allocator.py. Measured on an H100 (docs/memory.md, "On a
    GPU"), allocated predictions were within 0.73 % on all 30 plans of 5 models, and 29 fit their budget
    (the 30th, 0.7 % over, holds a block the default allocator hands out unsplit); reserved predictions
    were off by -25 % to +500 % (a 20 MiB segment the allocator never made for small models, and less
    fragmentation than it made for an MLP). So RESERVED is asked for by name, and is labelled predicted.
    """

    ALLOCATED = "allocated"
    """The peak of live tensor storages (`torch.cuda.max_memory_allocated`)."""
    RESERVED = "reserved"
    """The peak CUDA's caching allocator reserves (`torch.cuda.max_memory_reserved`), predicted."""

    @property
    def words(self) -> str:
        """What a report says the budget bounds."""
        if self is BudgetKind.RESERVED:
            return "reserved memory, as CUDA's caching allocator would reserve it (max_memory_reserved)"
        return "allocated memory (max_memory_allocated)"


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
    gradients in flight): where a replay the node triggers runs (NOTE [early stop] in simulation/step.py).
    None where it was not measured (module-level and synthetic graphs)."""
    replay_stop_bytes: int | None = None
    """What the node's forward holds on top of what was live before it, at its peak up to the moment it
    saves its last tensor: where a replay that it triggers stops (NOTE [early stop] in
    simulation/step.py), before the operators after that save (an opaque block's last ones) run. Set only
    where it is below the node's outputs and forward workspace; None elsewhere: such a replay runs the
    whole forward."""
    backward_points: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """(workspace bytes, storages freed before) at moments of the node's backward where its saved
    storages are freed part way, as a compiled backward frees them after their last reader (a weight
    gradient's input, read before the input gradient is made): the simulator subtracts those the
    schedule releases at this node (NOTE [early release] in simulation/step.py). An eager node of many
    autograd operators whose measured backward peak is below what holding its saves would give has one
    entry (NOTE [freed part way in eager backward] in profiler/calibration.py). Empty where the whole
    backward holds its saved storages, as eager autograd does: `backward_workspace_bytes` then."""
    replay_release_bytes: int = 0
    """How much lower the node's backward peaks where every storage it saves is a replay's copy, which
    checkpoint frees as soon as the backward formula is done with it rather than when the node's
    backward ends (NOTE [replay's early frees] in profiler/calibration.py). 0 where not measured."""
    parameter_gradient_bytes: int = 0
    """Parameter (and input) gradient bytes that first appear during this node's backward."""
    keep_cache_bytes: int = 0
    """What a selective checkpoint policy caches when it keeps this node: every storage its operators
    allocate, freed inside the node or not, less the outputs the policy replays (casts, scratch filled
    in place; `saved_when_kept` in profiler/selective_cost.py). See NOTE [selective keeps] in
    simulation/step.py."""
    replayed_when_kept: tuple[str, ...] = ()
    """Storages among `creates` that a selective policy makes again in the replay rather than cache when
    it keeps this node (a weight's autocast cast): they leave after their last reader as unkept ones do."""
    buffer_bytes: int = 0
    """Bytes of the module buffers the node reads (BatchNorm's statistics), as counted: a checkpointed
    region's replay copies them to restore them after it (NOTE [buffer copies] in
    simulation/replay.py)."""
    forward_flops: int = 0
    """FLOPs of the forward as `torch.utils.flop_counter` counts them (matmuls, convolutions)."""
    moved_bytes: int = 0
    """Bytes of the tensors the forward reads and writes: the memory-bound part of its cost."""
    operator_count: int = 1
    """Operators the forward dispatches: a selective checkpoint policy calls back once for each."""
    random: bool = False
    draws_python: bool = False
    """Whether the forward drew from Python's or NumPy's global generator when profiled (a layer that skips
    itself when `random.random()` says so, kept whole by the capture): a checkpoint holding the node sets
    those generators back for its replay (NOTE [Python draws replayed] in rewrite/emit.py)."""
    stateful: bool = False
    in_place: bool = False
    checkpointable: bool = True
    part_of: str = ""
    """The captured call this node is a part of, when that call runs as Python code the capture could
    not follow (an opaque module, split at its children's calls while profiling): the call's own code
    between child calls (op `GLUE_OP`) or one child call. Empty for every other node. A checkpointed
    region holds all the parts of such a call or exactly one child call (NOTE [split calls] in
    simulation/step.py)."""


GLUE_OP = "glue"
"""`Node.op` of a split call's own code between its children's calls (and of a module-level graph's
root code between its units)."""


@dataclass(frozen=True)
class StaticBytes:
    """Memory that no checkpoint schedule changes."""

    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    optimizer_step_workspace_bytes: int
    """Temporaries of `optimizer.step()` on top of parameters, gradients and state, as the optimizer's
    implementation (single-tensor, foreach or fused) runs on the planned device."""
    accumulated_gradient_bytes: int = 0
    """The parameters' `.grad` buffers: `gradient_bytes` less the inputs' gradients. Gradient accumulation
    keeps these between micro-batches."""
    resident_gradient_bytes: int = 0
    """Gradient bytes live through forward and backward: `accumulated_gradient_bytes` when the training
    step keeps gradients between micro-batches (see `for_training_step` in simulation/micro_batches.py),
    else 0."""
    forward_gradient_bytes: int = 0
    """Gradient bytes live through the forward alone, freed before backward: `accumulated_gradient_bytes`
    when `zero_grad` runs between forward and backward (Lightning's automatic optimization), else 0."""
    clip_workspace_bytes: int = 0
    """Temporaries of `clip_grad_norm_` on top of the gradients (per-gradient norms, the total norm)."""
    unscale_workspace_bytes: int = 0
    """Temporaries of `GradScaler.unscale_` on top of the gradients (found-inf flags, inverse scale)."""

    @property
    def resident_bytes(self) -> int:
        """Bytes live through forward and backward of a steady-state micro-batch."""
        return (
            self.parameter_bytes
            + self.buffer_bytes
            + self.input_bytes
            + self.optimizer_state_bytes
            + self.resident_gradient_bytes
        )


@dataclass(frozen=True)
class TrainingStep:
    """The training step a plan's budget holds for: what runs between two `optimizer.step()` calls.

    One step is `zero_grad`, then `accumulation_steps` micro-batches of forward, loss and backward,
    then (optionally) `GradScaler.unscale_` and `clip_grad_norm_`, then `optimizer.step()`. With
    `zero_grad_before_backward`, `zero_grad` runs after the first micro-batch's forward and loss instead.

    NOTE [loop orders]: where a loop zeroes the gradients decides how long the last step's gradients
    live, and so the peak:

    - before the forward (a plain PyTorch loop, the Hugging Face Trainer, Lightning's manual
      optimization and Fabric loops as their docs write them): no gradient during the forward; the
      default;
    - between forward and backward (Lightning's automatic optimization: `training_step`, then
      `optimizer_zero_grad`, then backward): the previous step's gradients are alive through the
      forward and freed before backward; `zero_grad_before_backward=True`, or
      `TrainingStep.from_lightning(trainer)`;
    - in place (`zero_grad(set_to_none=False)`) or with accumulation: gradients alive through forward
      and backward of every (later) micro-batch, whichever the order (`gradients_resident`).
    """

    accumulation_steps: int = 1
    """Micro-batches whose gradients are summed before each optimizer step (each with the example
    inputs' size). From the second on, every parameter's gradient is alive in forward and backward."""
    max_grad_norm: float | None = None
    """`torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)` before the step; None: no clipping."""
    grad_scaler: bool = False
    """fp16 training with `torch.amp.GradScaler`: the loss is scaled and the gradients unscaled in place
    (`scaler.unscale_`) before clipping and the step."""
    zero_grad_set_to_none: bool = True
    """`zero_grad(set_to_none=True)`, PyTorch's default: gradients are freed between steps. With False
    they are zeroed in place and stay alive through every forward."""
    zero_grad_before_backward: bool = False
    """`zero_grad` runs after the forward and the loss, before backward (Lightning's automatic
    optimization), not before the forward: the last step's gradients are alive through the forward
    (NOTE [loop orders]). With accumulation, only the first micro-batch of a step is zeroed so."""

    def __post_init__(self) -> None:
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"TrainingStep(accumulation_steps={steps!r}): must be an int >= 1 (micro-batches per "
                "optimizer step; 1 means no accumulation)"
            )
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, int | float) or not norm > 0):
            raise ValueError(
                f"TrainingStep(max_grad_norm={norm!r}): must be a positive number, or None for no clipping"
            )

    @property
    def gradients_resident(self) -> bool:
        """Whether gradients are alive through a micro-batch's forward and backward (some micro-batch)."""
        return self.accumulation_steps > 1 or not self.zero_grad_set_to_none

    @property
    def gradients_in_forward(self) -> bool:
        """Whether the last step's gradients are alive through some micro-batch's forward."""
        return self.gradients_resident or self.zero_grad_before_backward

    @classmethod
    def from_lightning(cls, trainer_or_module: Any) -> TrainingStep:
        """The step PyTorch Lightning runs for a `Trainer` (or a `LightningModule` attached to one):
        `accumulate_grad_batches`; `gradient_clip_val` with `gradient_clip_algorithm="norm"` (clipping by
        value works in place and costs no memory); a GradScaler for `precision="16-mixed"`. Automatic
        optimization zeroes gradients between forward and backward (NOTE [loop orders]); a module with
        `automatic_optimization = False` zeroes them where its `training_step` does, which the docs'
        recipe does before the forward, so its step is that one. bf16 and 16-bit autocast itself shapes the
        profiled graph: profile under the same autocast."""
        module = trainer_or_module if hasattr(trainer_or_module, "automatic_optimization") else None
        if module is not None and not module.automatic_optimization:
            return cls()
        trainer = getattr(module, "_trainer", None) if module is not None else trainer_or_module
        if trainer is None or not hasattr(trainer, "accumulate_grad_batches"):
            raise TypeError(
                "TrainingStep.from_lightning needs a pytorch_lightning Trainer, or a LightningModule "
                "with automatic_optimization = False, or one attached to a Trainer; got "
                f"{type(trainer_or_module).__name__}"
            )
        clip_value = getattr(trainer, "gradient_clip_val", None)
        clip_by_norm = getattr(trainer, "gradient_clip_algorithm", None) in (None, "norm")
        precision = str(getattr(trainer, "precision", "32-true"))
        return cls(
            accumulation_steps=int(trainer.accumulate_grad_batches),
            max_grad_norm=float(clip_value) if clip_value and clip_by_norm else None,
            grad_scaler=precision in ("16-mixed", "16"),
            zero_grad_before_backward=True,
        )

    @classmethod
    def from_training_args(cls, args: Any) -> TrainingStep:
        """The step Hugging Face's `Trainer` runs for `transformers.TrainingArguments` `args`:
        `gradient_accumulation_steps`, `max_grad_norm` (0 or None: no clipping) and `fp16` (which uses a
        GradScaler; bf16 does not). The Trainer zeroes gradients with `model.zero_grad()`, which sets
        them to None."""
        needed = ("gradient_accumulation_steps", "max_grad_norm", "fp16")
        missing = [name for name in needed if not hasattr(args, name)]
        if missing:
            raise TypeError(
                f"TrainingStep.from_training_args needs a transformers.TrainingArguments; "
                f"{type(args).__name__} has no {', '.join(missing)}"
            )
        norm = args.max_grad_norm
        return cls(
            accumulation_steps=int(args.gradient_accumulation_steps),
            max_grad_norm=float(norm) if norm else None,
            grad_scaler=bool(args.fp16),
        )


COMPILED_CAPTURE = "torch.compile"
"""How the capture of a compiled step's joint graph begins (planner/compiled/joint_graph.py)."""


@dataclass(frozen=True)
class ActivationGraph:
    """The model as the planner sees it: nodes in execution order, storages, static bytes."""

    nodes: tuple[Node, ...]
    storage_bytes: dict[str, int]
    static: StaticBytes
    capture: str
    """How the model was captured, e.g. "fx" or "fx (opaque: block.3)"."""
    optimizer: str
    timing: str = CostModel.MEASURED.value
    """Where per-node times come from: "measured" (profiling steps on the model's device) or
    "analytic (<device>)" (FLOPs and bytes on a roofline, see profiler/cost_model.py)."""
    selective_op_overhead_ms: float = 0.0
    """Time a selective checkpoint policy adds per dispatched operator of a region that keeps nodes
    (forward and replay together; see profiler/selective_cost.py)."""
    checkpoint_call_ms: float = 0.0
    """Time one checkpointed region adds beyond replaying its forward, once per region:
    `torch.utils.checkpoint`'s own work (RNG state saved and restored, the replay's set-up), forward and
    backward together (see profiler/selective_cost.py). It is why ten small regions cost more than one region
    of the same recompute."""
    checkpoint_op_ms: float = 0.0
    """Time a checkpointed region adds per operator of its nodes (`Node.operator_count`): checkpoint's
    Python hooks on every tensor the region saves, in forward and backward."""
    step: TrainingStep = TrainingStep()
    """The training step the graph's accounting describes (see `for_training_step` in
    simulation/micro_batches.py)."""
    memory_counting: MemoryCounting = MemoryCounting.BLOCKS
    """How each storage's bytes are counted in every figure of the graph (NOTE [counted bytes])."""

    @property
    def compiled(self) -> bool:
        """Whether the graph is a compiled step's (its regions recomputed by inductor's partitioner, not
        by `torch.utils.checkpoint`)."""
        return self.capture.startswith(COMPILED_CAPTURE)

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


def merge_stored(regions: Iterable[Region]) -> tuple[Region, ...]:
    """`regions` in order, adjacent STORE regions made one: a stored region's extent changes neither
    memory nor time, and fewer regions make fewer submodules in the rewritten model."""
    merged: list[Region] = []
    for region in regions:
        if merged and merged[-1].policy is RegionPolicy.STORE and region.policy is RegionPolicy.STORE:
            merged[-1] = Region(merged[-1].start, region.stop, RegionPolicy.STORE)
        else:
            merged.append(region)
    return tuple(merged)


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
    UNSCALE = "unscale"
    """`GradScaler.unscale_` after the last micro-batch's backward."""
    CLIP = "clip gradients"
    """`clip_grad_norm_` after the last micro-batch's backward."""
    OPTIMIZER = "optimizer step"

    @property
    def after_backward(self) -> bool:
        """Whether the phase runs on the finished gradients, when no activation is alive."""
        return self in (Phase.UNSCALE, Phase.CLIP, Phase.OPTIMIZER)


class Component(StrEnum):
    """What the bytes live at a moment of the step are, in the order reports list them. A breakdown is
    a `dict[Component, int]`; members are their string values, so it serialises as plain JSON."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    BUFFERS = "buffers"
    ACTIVATIONS = "activations"
    RECOMPUTE = "recompute"
    WORKSPACE = "workspace"

    @property
    def label(self) -> str:
        """The words a report uses for it."""
        return _COMPONENT_LABELS.get(self, self.value.replace("_", " "))

    @property
    def static(self) -> bool:
        """Whether no checkpoint plan changes it (parameters, gradients, optimizer state, inputs, buffers)."""
        return self in _STATIC_COMPONENTS


def breakdown_from(raw: Mapping[str, int]) -> dict[Component, int]:
    """A breakdown read from JSON (string keys); components this version does not know are left out."""
    known = {component.value for component in Component}
    return {Component(key): int(size) for key, size in raw.items() if key in known}


def breakdown_to_json(breakdown: Mapping[Component, int]) -> dict[str, int]:
    """A breakdown with plain string keys, as JSON and pydantic models hold it."""
    return {component.value: size for component, size in breakdown.items()}


_COMPONENT_LABELS = {Component.ACTIVATIONS: "kept activations", Component.RECOMPUTE: "recompute peak"}
_STATIC_COMPONENTS = frozenset(
    {
        Component.PARAMETERS,
        Component.GRADIENTS,
        Component.OPTIMIZER_STATE,
        Component.INPUTS,
        Component.BUFFERS,
    }
)


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
    breakdown: dict[Component, int]
    """Bytes by component at the peak."""
    retained_bytes: int = 0
    """Activation bytes alive between the end of the forward (and the loss) and the start of backward:
    what one more micro-batch in flight adds under a pipeline schedule (NOTE [stage memory] in
    simulation/pipeline.py)."""
    peak_micro_batch: str = ""
    """Which micro-batch sets a forward/backward peak, in words ("the second micro-batch's, with all
    gradients alive"); empty for a single micro-batch with gradients set to None, and after backward."""
    trace: tuple[TraceStep, ...] = field(repr=False, default=())

    @property
    def overhead(self) -> float:
        """Recompute time as a fraction of the step time without checkpointing."""
        return self.recompute_ms / self.step_ms if self.step_ms > 0 else 0.0
