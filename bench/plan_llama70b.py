"""Plan a 70B Llama-style model for 8-way FSDP x 4-way tensor x 4-way pipeline parallelism on H100s.

Why: the people who need a checkpoint planner most train across many cards, and a planner that must
run the model to plan it cannot plan them. Each of the 4 pipeline stages (20 of the 80 layers) is built
on the meta device as one tensor-parallel rank holds it, planned for a 1F1B schedule by
`planner.optimize_pipeline` with FSDP over 8 ranks, priced by the analytic cost model for an H100, and
each stage gets its own recompute. The script reports per-stage memory and time, planning wall time
and this process's peak RSS (targets: under 2 minutes and 4 GiB) and writes
`bench/results/llama70b.json` and the picture `docs/pipeline_llama70b.png` (docs/results.md quotes
both).

NOTE [a tensor parallel rank on the meta device]: `parallelize_module` cannot run without a process
group, so each stage is built as one rank of the 4-way tensor parallel group holds it (torchtitan's
plan without sequence parallelism, as planner/planning/tensor_parallel.py plans it on real ranks):
the column-wise projections (q, k, v, gate, up) hold 1/4 of their output features, so attention runs
over 16 of the 64 query heads and 2 of the 8 key/value heads and the MLP over 7,168 of 28,672 hidden
units; the row-wise projections (o, down) and the vocabulary-parallel embedding hold 1/4 of their
inputs and all-reduce their output into a new buffer (`_AllReduce`, a copy of the same size, saving
nothing for backward, as `_c10d_functional.all_reduce` allocates); the column-wise output head holds
1/4 of the vocabulary and all-gathers the logits (a new full-size buffer) for the replicated loss.
Key and value heads are repeated to the query heads before attention, as Hugging Face's Llama does,
so the meta device runs FlashAttention's memory (planner/profiler/attention.py).

    .venv/bin/python -m bench.plan_llama70b [--micro-batch 2] [--micro-batches 16] [--sequence 4096]
        [--card h100-80gb]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import planner
from bench.plan_llama7b import RMSNorm
from planner.profiler.cost_model import device_spec

log = logging.getLogger("bench.llama70b")


@dataclass(frozen=True)
class Parallelism:
    """How the 128 cards split the model: data (FSDP), tensor and pipeline degrees."""

    data: int = 8
    tensor: int = 4
    pipeline: int = 4


@dataclass(frozen=True)
class Llama70BConfig:
    """Llama 2 70B's shapes (hidden 8,192, 80 layers, 64 query and 8 key/value heads)."""

    vocab_size: int = 32000
    hidden_size: int = 8192
    intermediate_size: int = 28672
    layers: int = 80
    heads: int = 64
    key_value_heads: int = 8
    sequence: int = 4096
    micro_batch: int = 1


class _AllReduce(nn.Module):
    """A row-wise projection's all-reduce as one rank sees its memory: a new buffer of the same size
    that saves nothing for backward (NOTE [a tensor parallel rank on the meta device])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class _AllGather(nn.Module):
    """The column-wise output head's all-gather of the logits: a new buffer `ranks` times the shard."""

    def __init__(self, ranks: int) -> None:
        super().__init__()
        self.ranks = ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 1, self.ranks)


class RankAttention(nn.Module):
    """Grouped-query attention as one tensor parallel rank holds it: its share of the heads."""

    def __init__(self, config: Llama70BConfig, ranks: int) -> None:
        super().__init__()
        self.head_size = config.hidden_size // config.heads
        self.heads = config.heads // ranks
        self.key_value_heads = config.key_value_heads // ranks
        self.q = nn.Linear(config.hidden_size, self.heads * self.head_size, bias=False)
        self.k = nn.Linear(config.hidden_size, self.key_value_heads * self.head_size, bias=False)
        self.v = nn.Linear(config.hidden_size, self.key_value_heads * self.head_size, bias=False)
        self.o = nn.Linear(self.heads * self.head_size, config.hidden_size, bias=False)
        self.all_reduce = _AllReduce()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, _ = x.shape
        q = self.q(x).view(batch, sequence, self.heads, self.head_size).transpose(1, 2)
        k = self.k(x).view(batch, sequence, self.key_value_heads, self.head_size).transpose(1, 2)
        v = self.v(x).view(batch, sequence, self.key_value_heads, self.head_size).transpose(1, 2)
        groups = self.heads // self.key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.all_reduce(self.o(attended.transpose(1, 2).flatten(2)))


class RankBlock(nn.Module):
    """One decoder layer as one tensor parallel rank holds it (norms replicated, MLP split)."""

    def __init__(self, config: Llama70BConfig, ranks: int) -> None:
        super().__init__()
        hidden_share = config.intermediate_size // ranks
        self.attention_norm = RMSNorm(config.hidden_size)
        self.attention = RankAttention(config, ranks)
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.gate = nn.Linear(config.hidden_size, hidden_share, bias=False)
        self.up = nn.Linear(config.hidden_size, hidden_share, bias=False)
        self.down = nn.Linear(hidden_share, config.hidden_size, bias=False)
        self.all_reduce = _AllReduce()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        normed = self.mlp_norm(x)
        return x + self.all_reduce(self.down(F.silu(self.gate(normed)) * self.up(normed)))


class RankStage(nn.Module):
    """Pipeline stage `index` of `stages` as one tensor parallel rank holds it: its share of the
    layers, the first stage with the vocabulary-parallel embedding, the last with the norm and head."""

    def __init__(self, config: Llama70BConfig, parallelism: Parallelism, index: int) -> None:
        super().__init__()
        ranks, stages = parallelism.tensor, parallelism.pipeline
        per_stage = config.layers // stages
        self.first, self.last = index == 0, index == stages - 1
        if self.first:
            self.embed = nn.Embedding(config.vocab_size // ranks, config.hidden_size)
            self.embed_all_reduce = _AllReduce()
        self.blocks = nn.ModuleList(RankBlock(config, ranks) for _ in range(per_stage))
        if self.last:
            self.norm = RMSNorm(config.hidden_size)
            self.head = nn.Linear(config.hidden_size, config.vocab_size // ranks, bias=False)
            self.all_gather = _AllGather(ranks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed_all_reduce(self.embed(x))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.all_gather(self.head(self.norm(x)))
        return x


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=16, help="per data-parallel rank and step")
    parser.add_argument("--card", default="h100-80gb", help="a named card (planner/profiler/cost_model.py)")
    parser.add_argument("--out", default="bench/results/llama70b.json")
    parser.add_argument("--plot", default="docs/pipeline_llama70b.png", help="empty: no picture")
    return parser.parse_args()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    arguments = _arguments()
    config = Llama70BConfig(sequence=arguments.sequence, micro_batch=arguments.micro_batch)
    parallelism = Parallelism()
    load_before = os.getloadavg()
    started = time.perf_counter()
    with torch.device("meta"):
        stages = [
            RankStage(config, parallelism, index).to(torch.bfloat16) for index in range(parallelism.pipeline)
        ]
        tokens = torch.zeros(config.micro_batch, config.sequence, dtype=torch.long)
    rank_parameters = sum(p.numel() for stage in stages for p in stage.parameters())
    log.info("built %.2fB parameters per tensor parallel rank on the meta device", rank_parameters / 1e9)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    budget_bytes = device_spec(arguments.card).usable_memory_bytes
    pipeline = planner.optimize_pipeline(
        stages,
        (tokens,),
        schedule="1f1b",
        micro_batches=arguments.micro_batches,
        budget_bytes=budget_bytes,
        loss_fn=loss_fn,
        example_target=tokens,
        device=arguments.card,
        world_size=parallelism.data,
        sharding="fsdp",
    )
    wall_s = time.perf_counter() - started
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "command": ["python", "-m", "bench.plan_llama70b", *sys.argv[1:]],
        "config": asdict(config),
        "parallelism": asdict(parallelism),
        "parameters": rank_parameters * parallelism.tensor,
        "card": arguments.card,
        "budget_bytes": budget_bytes,
        "planning_wall_s": round(wall_s, 2),
        "load_before": [round(value, 1) for value in load_before],
        "peak_rss_bytes": peak_rss_bytes,
        "summary": pipeline.summary(),
        "stages": [asdict(report) for report in pipeline.stages],
        "regions": [len(plan.regions) for plan in pipeline.plans],
        "predicted_step_ms": pipeline.predicted_step_ms,
    }
    if arguments.plot:
        pipeline.plot(arguments.plot)
    Path(arguments.out).parent.mkdir(parents=True, exist_ok=True)
    Path(arguments.out).write_text(json.dumps(result, indent=1))
    sys.stdout.write(pipeline.summary() + "\n")
    sys.stdout.write(f"planning wall time {wall_s:.1f} s, peak RSS {peak_rss_bytes / 2**30:.2f} GiB\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
