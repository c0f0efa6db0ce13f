"""Sizing: `planner.capacity`, the largest batch or sequence a card fits, and the fastest way to a batch.

Stage 10 of planner/'s packages (docs/layout.md). It owns answering from a card rather than a budget:
`capacity` and its result table `Capacity` (`capacity`), the size search they are computed from, which
profiles the model at the sizes it probes, keeps the graphs and plans the answer (`search`), the
torch-free bisection over sizes and the weighing of checkpointing, gradient accumulation and bf16
autocast against one another (`fitting`), and one model's activation graph at other sizes from captures
at three, when the graph only rescales (`rescale`, NOTE [rescaling]).

It may import every earlier stage, the one-call entry points (planner.one_call) among them: a table's
plan is `optimize` at the size it found. `fitting` and `rescale` never import torch; `capacity` and
`search` do.
Nothing of the planner imports it but `planner.capacity`, loaded on first use.

It is `sizing`, not `capacity`: `planner.capacity` is a public function, and a package of that name
would replace it on the `planner` module once imported (tests/test_layout.py).
"""
