"""Capture: a model and an example call turned into a torch.fx GraphModule the planner profiles and rewrites.

Stage 2 of planner/'s packages (docs/layout.md). It owns the capture chain (`chain`: torch.fx tracing,
torch.export when fx fails at the root), what a capture hands on (`records`: `Capture`, `GraphCall` and
the shapes a captured graph admits), in-place ops run out of place where nothing observes the write
(`in_place`), the attention masks an export materialises where the model makes none, dropped again
(`attention_masks`), torch.export of the containers fx cannot trace, inlined into the fx graph
(`submodule_export`), and the last level of the chain, one call of the whole model for the profiler to
split at its submodules (`model_call`).

It may import the contract (planner.ir, planner.errors) and torch, and nothing else of the planner: the
profiler, the rewrite and the planning of a model import it, so it never imports them.
"""
