"""Per-node time from an analytic cost model: FLOPs and bytes moved on a named device (a roofline).

Measured times (`cost_model="measured"`, the default) come from the profiling step itself. They need
the model's real device. The analytic model needs neither the device nor real tensors, so a laptop can
plan for an H100, and a model built on the meta device can be planned at all:

    forward_ms = max(flops / peak_flops, moved_bytes / bandwidth) + overhead_ms
    backward_ms = BACKWARD_FACTOR * forward_ms

FLOPs come from `torch.utils.flop_counter` (matmuls, convolutions, attention); operators it does not
count are memory-bound and priced by the bytes they read and write (none for a view); random
operators (dropout) write at the device's random-number rate. The peak rates are datasheet
figures (dense, no sparsity), so absolute times are optimistic; the planner only needs their ratios.

A card named with its memory (`"a100-40gb"`, `"h100-80gb"`, `"rtx4090"`) also carries that memory,
the nominal size in GiB (an "80 GB" card has 80 GiB), and what comes off it before any tensor of the
step: `planner.capacity` and `optimize(..., device=card)` without a budget plan against the rest
(`usable_memory_bytes`), and say how much was held back (NOTE [held back]).

NOTE [held back]: two allowances, each from a cited source, both replaced by a measurement on the
card by `make gpu-check` (bench/gpu_check.py):
- The CUDA context (driver state, the kernels' code, library handles), which the caching allocator
  never sees: a PyTorch process showed 723 MiB after its first one-element CUDA tensor
  (discuss.pytorch.org/t/73021), and PyTorch's maintainers answer "~700+ MB depending on the CUDA
  version and device" (discuss.pytorch.org/t/81330; ~800 MB in that thread's question). We hold back
  `CUDA_CONTEXT_BYTES`, 1 GiB: the largest reported figure, rounded up, because lazy module loading
  (CUDA 11.7+) lowers it and eager loading or more libraries raise it.
- cuBLAS workspaces, which the caching allocator does hand out (so `max_memory_allocated` counts them,
  and our step's prediction, made from tensor storages, does not): `getChosenWorkspaceSize` in
  aten/src/ATen/cuda/CublasHandlePool.cpp gives 32 MiB on compute capability 9.x and later (H100) and
  `:4096:2:16:8` (8 MiB + 128 KiB) before (A100, L40S, RTX 4090), one per cuBLAS handle and stream;
  cuBLASLt shares it (unified workspace, the default in torch 2.13). A training step holds two
  handles, the forward's thread's and autograd's device thread's, so two workspaces.
Fragmentation (reserved above allocated) is not held back here: the allocator simulation predicts it
for each plan (simulation/allocator.py).

NOTE [card memory]: a card's memory is what the driver reports (`torch.cuda.get_device_properties(d)
.total_memory`, deviceQuery's "Total amount of global memory"), not its name's round number: the
driver keeps some for itself (ECC, page tables). Two figures are known: the H100 80GB HBM3 lent to
this project reported 85,017,493,504 B (79.18 GiB; bench/results/gpu_check.json, `total_bytes`), and an
A100-SXM4-40GB's deviceQuery shows 42,298,834,944 B (39.39 GiB; published in
github.com/bottlerocket-os/bottlerocket pull 3873). Those are 1.0 % and 1.5 % under the nominal
80 and 40 GiB. For the cards with no figure we take the nominal memory less the larger of the two
shares (`_REPORTED_SHARE`), an estimate that errs towards a smaller card; `make gpu-check` on the card
reports its real figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.errors import GIB

__all__ = [
    "BACKWARD_FACTOR",
    "CUDA_CONTEXT_BYTES",
    "DEVICES",
    "DeviceSpec",
    "analytic_forward_ms",
    "cublas_workspace_bytes",
    "device_spec",
]

BACKWARD_FACTOR = 2.0
"""Backward costs about twice the forward: a gradient for the input and one for the weight."""
CUDA_CONTEXT_BYTES = GIB
"""What a CUDA context takes off a card, as an allowance (NOTE [held back])."""
TRAINING_CUBLAS_HANDLES = 2
"""cuBLAS handles a training step uses: the forward's thread's and autograd's device thread's."""


def cublas_workspace_bytes(compute_capability_major: int) -> int:
    """cuBLAS's workspace per handle and stream on a card of this compute capability, as
    `getChosenWorkspaceSize` in aten/src/ATen/cuda/CublasHandlePool.cpp picks it by default."""
    if compute_capability_major >= 9:
        return 4096 * 8 * 1024  # ":4096:8": 32 MiB on Hopper and Blackwell
    return 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of a device for the roofline."""

    name: str
    flops_per_s: float
    """Dense matmul throughput at the training precision (TF32/bf16 tensor cores on GPUs)."""
    memory_bytes_per_s: float
    overhead_ms: float
    """Fixed cost per operator: kernel launch on a GPU, dispatch on a CPU."""
    random_bytes_per_s: float | None = None
    """Rate at which a random operator (dropout) writes its output; None: as fast as memory. A CPU
    draws each random number in software, about ten times slower than it streams memory."""
    device_type: str = "cuda"
    """The torch device type a step on this device uses: it decides the optimizer's default
    implementation (foreach on CUDA, single-tensor on the CPU; NOTE [optimizer implementation])."""
    selective_op_overhead_ms: float = 0.025
    """Host time a selective checkpoint policy adds per operator (its Python callback in forward and
    replay), as measured on this project's CPU; `selective_cost.py` measures it when times are."""
    checkpoint_call_ms: float = 0.1
    """Host time one checkpoint call adds beyond its replay (RNG state, replay set-up), an estimate;
    `selective_cost.py` measures it when times are measured (0.22 to 0.27 ms on this project's CPU,
    NOTE [checkpoint's own work], where the analytic plans of bench/results were made with 0.1)."""
    checkpoint_op_ms: float = 0.015
    """Host time checkpoint's saved-tensor hooks add per operator of a checkpointed region (estimate)."""
    memory_bytes: int | None = None
    """The device's memory (nominal, see above), or None where the name does not fix it ("a100" comes
    with 40 or 80 GiB, "h100" with 80 or 94, a CPU has what the machine has)."""
    context_bytes: int = 0
    """Memory the CUDA context takes before any tensor (NOTE [held back]); 0 for a CPU."""
    library_workspace_bytes: int = 0
    """Memory libraries take through the caching allocator on first use: cuBLAS's workspaces."""

    @property
    def held_back_bytes(self) -> int:
        """What comes off the card's memory before the training step's own tensors."""
        return self.context_bytes + self.library_workspace_bytes

    @property
    def usable_memory_bytes(self) -> int | None:
        """The card's memory less what is held back: what a step's peak may reach (None: unknown)."""
        return None if self.memory_bytes is None else self.memory_bytes - self.held_back_bytes


def _cuda_card(spec: DeviceSpec, compute_capability_major: int) -> DeviceSpec:
    """`spec` with what a CUDA card of this compute capability holds back (NOTE [held back])."""
    workspace_bytes = TRAINING_CUBLAS_HANDLES * cublas_workspace_bytes(compute_capability_major)
    return replace(spec, context_bytes=CUDA_CONTEXT_BYTES, library_workspace_bytes=workspace_bytes)


_REPORTED_SHARE = 42_298_834_944 / (40 * GIB)
"""Of an A100 40GB's nominal memory, the share its driver reports (NOTE [card memory]): 0.985."""


def _reported_memory_bytes(nominal_gib: int) -> int:
    """A card's memory as its driver would report it, estimated from its nominal size (NOTE [card
    memory]), rounded down to whole MiB."""
    return int(nominal_gib * GIB * _REPORTED_SHARE) // 2**20 * 2**20


_H100 = _cuda_card(DeviceSpec("h100", flops_per_s=989e12, memory_bytes_per_s=3.35e12, overhead_ms=0.005), 9)
_A100 = _cuda_card(DeviceSpec("a100", flops_per_s=312e12, memory_bytes_per_s=2.0e12, overhead_ms=0.005), 8)

DEVICES: dict[str, DeviceSpec] = {
    "h100": _H100,
    "h100-80gb": replace(_H100, name="h100-80gb", memory_bytes=85_017_493_504),
    "a100": _A100,
    "a100-40gb": replace(_A100, name="a100-40gb", memory_bytes_per_s=1.555e12, memory_bytes=42_298_834_944),
    "a100-80gb": replace(
        _A100, name="a100-80gb", memory_bytes_per_s=2.039e12, memory_bytes=_reported_memory_bytes(80)
    ),
    "l40s": _cuda_card(
        DeviceSpec(
            "l40s",
            flops_per_s=362e12,
            memory_bytes_per_s=0.864e12,
            overhead_ms=0.005,
            memory_bytes=_reported_memory_bytes(48),
        ),
        8,
    ),
    "rtx4090": _cuda_card(
        DeviceSpec(
            "rtx4090",
            flops_per_s=165e12,
            memory_bytes_per_s=1.008e12,
            overhead_ms=0.005,
            memory_bytes=_reported_memory_bytes(24),
        ),
        8,
    ),
    "cpu": DeviceSpec(
        "cpu",
        flops_per_s=100e9,
        memory_bytes_per_s=20e9,
        overhead_ms=0.01,
        random_bytes_per_s=2e9,
        device_type="cpu",
    ),
}
"""Memory as the driver reports it (NOTE [card memory]) and datasheet rates: bf16 dense tensor-core
throughput with fp32 accumulation (the RTX 4090's is half its fp16-accumulate figure) and memory
bandwidth (SXM parts for H100 and A100)."""


def device_spec(device: str | DeviceSpec) -> DeviceSpec:
    """A named device (`"h100"`, `"a100-40gb"`, `"rtx4090"`, `"cpu"`, ...) or a spec given by hand."""
    if isinstance(device, DeviceSpec):
        if device.flops_per_s <= 0 or device.memory_bytes_per_s <= 0 or device.overhead_ms < 0:
            raise ValueError(f"a DeviceSpec needs positive rates and a non-negative overhead, got {device}")
        if device.memory_bytes is not None and device.memory_bytes <= 0:
            raise ValueError(f"a DeviceSpec's memory_bytes must be positive or None, got {device}")
        if device.context_bytes < 0 or device.library_workspace_bytes < 0:
            raise ValueError(f"a DeviceSpec's context and workspace bytes must not be negative, got {device}")
        usable = device.usable_memory_bytes
        if usable is not None and usable <= 0:
            raise ValueError(
                f"a DeviceSpec's memory_bytes ({device.memory_bytes}) must exceed what is held back for the "
                f"CUDA context and library workspaces ({device.held_back_bytes}), got {device}"
            )
        return device
    if device not in DEVICES:
        raise ValueError(
            f"device={device!r} is not known; use one of {sorted(DEVICES)} or "
            "DeviceSpec(name, flops_per_s=..., memory_bytes_per_s=..., overhead_ms=...)"
        )
    return DEVICES[device]


def analytic_forward_ms(flops: int, moved_bytes: int, spec: DeviceSpec, *, random: bool = False) -> float:
    """Roofline time of one node's forward; a `random` node's bytes go at `random_bytes_per_s`."""
    compute_s = flops / spec.flops_per_s
    memory_rate = spec.random_bytes_per_s if random and spec.random_bytes_per_s else spec.memory_bytes_per_s
    memory_s = moved_bytes / memory_rate
    return max(compute_s, memory_s) * 1e3 + spec.overhead_ms
