"""Planning: the pipeline put together for a model or a graph captured elsewhere, and the `Plan` it returns.

Stage 7 of planner/'s packages (docs/layout.md). It owns what a caller plans with: `Plan`, a `SolvedPlan`
with the profiled step it was solved on and the methods that solve it again or show it (`plan`); solving a
captured graph at one budget or many, `plan_graph`, `pareto_frontier` and `Frontier` (`graph`); and
`profile`/`Profile`, a model captured, profiled and sharded once, then solved and rewritten at any budget
(`model`), sharded for FSDP by the units `fsdp_units` works out; and the checks of the user's arguments that
every way in shares, where string options become the enums of ir.py (`arguments`).

It may import every earlier stage: the contract, planner.simulation, planner.capture, planner.profiler,
planner.solvers, planner.rewrite and planner.report. `plan` and `graph` never import torch at import
time: `import planner` loads `plan`, and the service solves posted graphs with `graph`; `model` imports
torch. `compile=True` (planner.compiled), the one-call entry points (planner.one_call) and the size search
(planner.sizing) build on it, so it never imports them.
"""
