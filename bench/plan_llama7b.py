"""Plan a 7B Llama-style model for an 80 GiB H100 on this CPU machine, without allocating its weights.

Why: a planner that must run the model to plan it cannot plan the models that need planning. The
model is built on the meta device (shapes, no storage), captured and profiled there, priced by the
analytic cost model for an H100, and solved. The script reports planning wall time and this process's
peak RSS (targets: under 2 minutes and 4 GiB) and writes `bench/results/llama7b.json`
(docs/results.md quotes it).

    .venv/bin/python -m bench.plan_llama7b [--layers 32] [--budget-gib 80] [--sequence 2048]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import planner

log = logging.getLogger("bench.llama7b")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    layers: int = 32
    heads: int = 32
    sequence: int = 2048
    batch: int = 1


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_size = config.hidden_size // config.heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, self.head_size)).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        normed = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))


class LlamaStyle(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--sequence", type=int, default=2048)
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--out", default="bench/results/llama7b.json")
    return parser.parse_args()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    arguments = _arguments()
    config = LlamaConfig(layers=arguments.layers, sequence=arguments.sequence)
    started = time.perf_counter()
    with torch.device("meta"):
        model = LlamaStyle(config).to(torch.bfloat16)
        tokens = torch.zeros(config.batch, config.sequence, dtype=torch.long)
    parameter_count = sum(p.numel() for p in model.parameters())
    log.info("built %.2fB parameters on the meta device", parameter_count / 1e9)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    try:
        plan = planner.optimize(
            model,
            (tokens,),
            budget_gb=arguments.budget_gib,
            loss_fn=loss_fn,
            cost_model="analytic",
            device="h100",
            solver=arguments.solver,
        )
        outcome = {
            "feasible": True,
            "summary": plan.summary(),
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "baseline_peak_bytes": plan.baseline_peak_bytes,
            "min_peak_bytes": plan.min_peak_bytes,
            "predicted_overhead": plan.predicted_overhead,
            "solver": plan.solver,
            "checkpointed_regions": len(plan.regions),
            "nodes": len(plan.graph.nodes),
        }
    except planner.InfeasibleBudget as error:
        outcome = {"feasible": False, "message": str(error), "min_peak_bytes": error.min_peak_bytes}
    wall_s = time.perf_counter() - started
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "command": ["python", "-m", "bench.plan_llama7b", *sys.argv[1:]],
        "parameters": parameter_count,
        "config": config.__dict__,
        "budget_gib": arguments.budget_gib,
        "planning_wall_s": round(wall_s, 2),
        "peak_rss_bytes": peak_rss_bytes,
        **outcome,
    }
    Path(arguments.out).parent.mkdir(parents=True, exist_ok=True)
    Path(arguments.out).write_text(json.dumps(result, indent=1))
    sys.stdout.write(outcome.get("summary", outcome.get("message", "")) + "\n")
    sys.stdout.write(f"planning wall time {wall_s:.1f} s, peak RSS {peak_rss_bytes / 2**30:.2f} GiB\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
