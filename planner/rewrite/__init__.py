"""The rewrite: a schedule turned into the checkpointed module that trains in the model's place.

Stage 5 of planner/'s packages (docs/layout.md). It owns the module a plan hands back: `emit` fuses each
checkpointed region of the captured graph into a submodule that runs under torch.utils.checkpoint, in a
subclass of the model's own class that passes for it (NOTE [drop-in]); `other_shapes` runs calls at
shapes other than the example's on a graph captured at their shape, with the plan's regions carried
over (NOTE [carried regions]); `units` checkpoints a model planned by its submodules, one unit at a
time, without a graph.

It may import the contract (planner.ir, planner.errors), planner.capture (the captured graph it rewrites,
and capturing again at another shape) and planner.profiler (what a selective keep saves), and torch; the
solvers and the report never import it, and the planning of a model does.
"""
